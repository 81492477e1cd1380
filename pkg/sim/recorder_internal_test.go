package sim

import (
	"fmt"
	"testing"
)

func TestRecorderBounds(t *testing.T) {
	rc := newRecorder()
	for i := range recordIDs + 10 {
		rc.add(&RecordedRequest{ID: fmt.Sprint("id-", i), Body: []byte("x")})
	}
	for range recordPerID + 5 {
		rc.add(&RecordedRequest{ID: "hot", Body: []byte("yy")})
	}
	if n := len(rc.byID); n > recordIDs {
		t.Errorf("%d ids kept", n)
	}
	if got := rc.get("id-0"); len(got) != 0 {
		t.Errorf("the oldest id is still kept: %+v", got)
	}
	if got := rc.get("hot"); len(got) != recordPerID || got[0].Seq >= got[len(got)-1].Seq {
		t.Errorf("hot id keeps %d requests", len(got))
	}
	total := 0
	for _, list := range rc.byID {
		for _, r := range list {
			total += len(r.Body)
		}
	}
	if total != rc.bytes {
		t.Errorf("byte count %d, bodies hold %d", rc.bytes, total)
	}
	last := rc.last()
	if len(last) != recordRecent || last[len(last)-1].ID != "hot" || last[0].Seq >= last[len(last)-1].Seq || last[0].Body != nil {
		t.Errorf("last = %d requests, first %+v", len(last), last[0])
	}
}

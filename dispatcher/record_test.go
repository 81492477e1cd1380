package dispatcher

import (
	"context"
	"errors"
	"testing"
)

// TestRecordRead checks pdq's own direct read of a record against the
// KeyValue's Get, which it stands in for: the same value and revision for
// a record, and no record for one never written, deleted or purged; and
// the fallback on that Get where no server answers direct gets.
func TestRecordRead(t *testing.T) {
	ctx := context.Background()
	_, js := startJetStream(t)
	records, err := OpenRecords(ctx, js)
	if err != nil {
		t.Fatal(err)
	}
	kv := records.kv
	direct := *records
	direct.kv = nil // no fallback: a direct get that went astray fails here
	noDirect := *records
	noDirect.get = "$JS.API.DIRECT.GET.KV_pdq_nobody.$KV.pdq_nobody."
	for _, tc := range []struct {
		name  string
		write func(id string) error
		found bool
	}{
		{"never written", func(string) error { return nil }, false},
		{"written", func(id string) error { _, err := kv.Put(ctx, id, []byte(`{"id":"x"}`)); return err }, true},
		{"written twice", func(id string) error {
			if _, err := kv.Put(ctx, id, []byte(`{"id":"x"}`)); err != nil {
				return err
			}
			_, err := kv.Put(ctx, id, []byte(`{"id":"x","generation":2}`))
			return err
		}, true},
		{"deleted", func(id string) error {
			if _, err := kv.Put(ctx, id, []byte(`{}`)); err != nil {
				return err
			}
			return kv.Delete(ctx, id)
		}, false},
		{"purged", func(id string) error {
			if _, err := kv.Put(ctx, id, []byte(`{}`)); err != nil {
				return err
			}
			return kv.Purge(ctx, id)
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := "read-" + PoolName(tc.name)
			if err := tc.write(id); err != nil {
				t.Fatal(err)
			}
			e, kerr := kv.Get(ctx, id)
			if found := kerr == nil; found != tc.found {
				t.Fatalf("the KeyValue's Get: %v", kerr)
			}
			for name, rs := range map[string]*Records{"direct": &direct, "fallback": &noDirect} {
				data, rev, err := rs.read(ctx, id)
				switch {
				case !tc.found && !errors.Is(err, ErrNoRecord):
					t.Errorf("%s: %s, %d, %v; want ErrNoRecord", name, data, rev, err)
				case tc.found && (err != nil || string(data) != string(e.Value()) || rev != e.Revision()):
					t.Errorf("%s: %s, %d, %v; want %s, %d", name, data, rev, err, e.Value(), e.Revision())
				}
			}
			if !tc.found {
				return
			}
			// At its revision a record is left undecoded; at any other, read.
			if r, _, err := records.GetChanged(ctx, id, e.Revision()); r != nil || err != nil {
				t.Errorf("at its revision: %+v, %v; want no record, undecoded", r, err)
			}
			if r, _, err := records.GetChanged(ctx, id, e.Revision()-1); r == nil || err != nil {
				t.Errorf("past its revision: %+v, %v; want the record", r, err)
			}
		})
	}
}

// Package natsstats reads what a NATS server in the tool's own process
// has counted: each connection's messages and bytes, JetStream's API
// requests and each stream's last sequence. The tools that measure pdq's
// cost in NATS take one before and one after, and compare.
package natsstats

import "github.com/nats-io/nats-server/v2/server"

// Counts are a connection's counters, or a group's summed. In is what the
// server received: what the connections sent.
type Counts struct {
	Conns                              int
	InMsgs, OutMsgs, InBytes, OutBytes int64
}

// Sub is c less b.
func (c Counts) Sub(b Counts) Counts {
	return Counts{c.Conns, c.InMsgs - b.InMsgs, c.OutMsgs - b.OutMsgs, c.InBytes - b.InBytes, c.OutBytes - b.OutBytes}
}

// Add is c and d summed.
func (c Counts) Add(d Counts) Counts {
	return Counts{c.Conns + d.Conns, c.InMsgs + d.InMsgs, c.OutMsgs + d.OutMsgs, c.InBytes + d.InBytes, c.OutBytes + d.OutBytes}
}

// Snap is the server's counters at one moment.
type Snap struct {
	Conns   map[string]Counts // by connection name (summed; "(unnamed)" for none)
	Streams map[string]uint64 // last sequence, by stream
	API     uint64            // JetStream API requests (pulls are not among them)
}

// Take reads srv's counters.
func Take(srv *server.Server) (Snap, error) {
	s := Snap{Conns: map[string]Counts{}, Streams: map[string]uint64{}}
	cz, err := srv.Connz(&server.ConnzOptions{Limit: 1 << 16})
	if err != nil {
		return s, err
	}
	for _, c := range cz.Conns {
		name := c.Name
		if name == "" {
			name = "(unnamed)"
		}
		s.Conns[name] = s.Conns[name].Add(Counts{1, c.InMsgs, c.OutMsgs, c.InBytes, c.OutBytes})
	}
	jz, err := srv.Jsz(&server.JSzOptions{Streams: true, Accounts: true})
	if err != nil {
		return s, err
	}
	s.API = jz.API.Total
	for _, a := range jz.AccountDetails {
		for _, st := range a.Streams {
			s.Streams[st.Name] = st.State.LastSeq
		}
	}
	return s, nil
}

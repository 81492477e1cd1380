package dispatcher

import (
	"strconv"

	"github.com/nats-io/nats.go"
)

// Cancel broadcasts the cancel of request id's generation: the running
// jobs of that generation and earlier ones stop, not those of a later one
// (a retry of the id, already under way).
func Cancel(nc *nats.Conn, id string, generation int) error {
	m := nats.NewMsg(CancelSubject(id))
	m.Header[HeaderGeneration] = []string{strconv.Itoa(generation)}
	return nc.PublishMsg(m)
}

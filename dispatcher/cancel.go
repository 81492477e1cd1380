package dispatcher

import (
	"strconv"

	"github.com/nats-io/nats.go"
)

// Cancel broadcasts the cancel of request id, the one claimed at
// generation origin (Job.Origin): its running jobs stop, whatever their
// generation, and not those of a retry of the id, already under way.
func Cancel(nc *nats.Conn, id string, origin int) error {
	m := nats.NewMsg(CancelSubject(id))
	m.Header[HeaderOrigin] = []string{strconv.Itoa(origin)}
	return nc.PublishMsg(m)
}

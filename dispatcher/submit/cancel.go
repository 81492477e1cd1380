package submit

import (
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/pdq-dev/pdq/dispatcher"
)

// Cancel broadcasts the cancel of request id, the one claimed at
// generation origin (Job.Origin): its running jobs stop, whatever their
// generation, and not those of a retry of the id, already under way.
func Cancel(nc *nats.Conn, id string, origin int) error {
	m := nats.NewMsg(dispatcher.CancelSubject(id))
	m.Header[dispatcher.HeaderOrigin] = []string{strconv.Itoa(origin)}
	return nc.PublishMsg(m)
}

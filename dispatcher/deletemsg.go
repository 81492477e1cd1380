package dispatcher

import (
	"context"
	"errors"
	"strings"

	"github.com/nats-io/nats.go/jetstream"
)

// DeleteMsg deletes message seq of st. A message already gone (deleted,
// aged out, or replaced by a newer message of its subject in a stream
// that keeps one) is not an error. JetStream answers a delete of a
// missing message with error 10057, "no message found", not with the
// 10037 of jetstream.ErrMsgNotFound, which only a read gets; and the
// client keeps only the text of that answer.
func DeleteMsg(ctx context.Context, st jetstream.Stream, seq uint64) error {
	err := st.DeleteMsg(ctx, seq)
	if errors.Is(err, jetstream.ErrMsgNotFound) ||
		errors.Is(err, jetstream.ErrMsgDeleteUnsuccessful) && strings.Contains(err.Error(), "no message found") {
		return nil
	}
	return err
}

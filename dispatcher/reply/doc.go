// Package reply is the protocol that carries a worker's answer back to the
// gateway holding its client: the worker's [Writer] and the gateway's
// [Stream], each a state machine, with the messages between them (chunks,
// beats, acks, resends, done, error, moved) documented in one place, at
// the top of reply.go. Core NATS may lose a message, so nothing counts as
// delivered until the gateway acks it.
package reply

// Package dispatcher is the JetStream contract every pdq component shares:
// subjects, the stream and consumer topology, message envelopes, Submit on
// the gateway side, and the stage loop with its ack policy on the worker
// side, plus cancel, dead letters, replay and request state.
//
// It sits between package gateway and package workers in the request flow;
// it arrives with the P/D pipeline (issue #3).
package dispatcher

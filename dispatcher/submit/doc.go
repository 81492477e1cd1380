// Package submit is the gateway's side of the JetStream contract: it
// claims a request's id in its record (one id is one request, whatever
// path it takes), publishes the job, refuses a job when its pool's queue
// is full (429, before anything is written), broadcasts a cancel, and
// keeps the record writes NATS did not take until it does (the Ledger).
// The workers never import it.
package submit

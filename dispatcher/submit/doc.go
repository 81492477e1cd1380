// Package submit is the gateway's side of the JetStream contract: it
// claims a request's id in its record (one id is one request, whatever
// path it takes), publishes the job, refuses a job when its pool's queue
// is full (429, before anything is written), and broadcasts a cancel.
// The workers never import it.
package submit

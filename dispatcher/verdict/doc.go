// Package verdict is the settle table: what becomes of a job's delivery
// once its handler has returned. A handler says how it failed by wrapping
// its error (Permanent, Rejected, Retryable, HandBack, Unread, Reported);
// the stage loop (package stage) gathers the delivery's Facts and how the
// handler ended (its Outcome), Decide picks the Verdict, and Effects says,
// in one place, what each verdict does to the job's message, the request's
// record, the client's answer, the handoff's KV and the dead-letter
// stream. The package is pure, so that the table can be read, and tested
// as a table, apart from the runtime that carries it out (the stage
// loop's settle). Before a delivery runs, the stage loop's admit settles
// one that must not run with the same steps: drop, stop, expire,
// regenerate, fail.
package verdict

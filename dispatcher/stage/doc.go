// Package stage is the worker runtime: the stage [Loop] that pulls a
// stage's jobs (package pull), admits them, runs the handler (package
// workers gives one per stage) and settles every delivery: ack, retry,
// hand-back, a new generation, a dead letter, the KV's release. How a
// delivery settles is one table, settle_table.go: decide picks the
// verdict, effects says what it does to the message, the record, the
// client, the KV and the dead-letter stream.
//
// Read it after packages dispatcher, pull and reply, and before package
// workers.
package stage

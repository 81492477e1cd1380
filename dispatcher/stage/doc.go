// Package stage is the worker runtime: the stage [Loop] that pulls a
// stage's jobs (package pull), admits them, runs the handler (package
// workers gives one per stage) and settles every delivery: ack, retry,
// hand-back, a new generation, a dead letter, the KV's release. How a
// delivery that ran settles is one table, package verdict: the loop
// gathers the delivery's facts, verdict.Decide picks the verdict, and
// settle.carry carries it out.
//
// Read it after packages dispatcher, pull, reply and verdict, and before
// package workers.
package stage

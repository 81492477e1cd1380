// Package admin is the operator's side of JetStream: the [Replayer] that
// runs dead-lettered requests again, the queues' status ([Queues]), and
// the [StoreDoctor], which finds a stream whose disk filled (its store
// latched a write error) and rebuilds it once it can write again. pdq's
// tools use it, and the gateway runs the doctor for /ready.
package admin

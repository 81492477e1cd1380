// Package pull is how a worker takes jobs off JetStream, and no more than
// its engine can run: the [Puller] sends one pull request per free slot on
// a subscription it keeps; the [DecodeGate] holds a prefill back while the
// decode backlog is more than its KV can wait for; the [EngineSlots] share
// one engine between the stage loops of the models it serves; the
// [Keeper] keeps a stream's last file block from emptying; [TakeOver]
// finds the jobs that wait for another engine which cannot take them. The
// stage loop (package stage) decides what to do with a job once it has it.
package pull

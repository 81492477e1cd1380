// Package dispatcher is the JetStream contract every pdq component shares,
// and nothing else: the subjects, the streams and consumers ([Ensure]),
// the job envelope and its versions ([Job]), the request records
// ([Records]), the worker's heartbeat message ([WorkerInfo]), and the
// publishing and dead-lettering of a job that every side does the same
// way ([Publish], [DeadLetterJob]). What runs on the contract lives in the
// packages below it, each one idea:
//
//   - submit: the gateway's side: claim a request's id, publish its job,
//     refuse when the queue is full, cancel, and the ledger of record
//     writes kept while NATS is away;
//   - fair and affinity: the gateway's scheduling: which waiting request
//     goes in next, and which prefill engine a job prefers;
//   - reply: the protocol that carries tokens back, writer and reader;
//   - registry: who is there: the workers' heartbeats and the gateways'
//     liveness;
//   - pull: how a worker takes jobs: pulls, the decode gate, engine slots,
//     the take-over of jobs waiting for an engine that cannot take them;
//   - verdict: the settle table: what becomes of a delivery once its
//     handler returns;
//   - stage: the worker runtime: the stage loop, which carries each
//     delivery's verdict out;
//   - enginecall: the gateway's direct calls to a worker's engine;
//   - admin: replay, queue status, the store doctor.
//
// A request flows like this. The gateway publishes a [Job] to
// pdq.prefill.<pool>.<id> (or straight to pdq.decode.<pool>.<id> for a short
// prompt). A prefill worker's stage loop pulls it when its engine has a
// free slot, runs the prefill, publishes the handoff (the job plus the
// engine's kv_transfer_params) to pdq.decode.<pool>.<id>, waits for the
// PubAck, and only then acks. A decode worker pulls the handoff, runs
// generation, and relays each SSE event as a numbered chunk on the
// gateway's reply subject, ending with a terminal message.
//
// Read it after package gateway; then submit, reply, registry, pull,
// verdict and stage, and package workers last.
package dispatcher

// Package dispatcher is the JetStream contract every pdq component shares:
// the subjects, the streams and consumers ([Ensure]), the message envelopes
// ([Job]), [Submitter] on the gateway side, the stage loop with its ack
// policy ([StageLoop]) on the worker side, the numbered reply stream that
// carries tokens back ([ReplyWriter], [Replies]), and the worker registry.
//
// A request flows like this. The gateway publishes a [Job] to
// pdq.prefill.<pool>.<id> (or straight to pdq.decode.<pool>.<id> for a short
// prompt). A prefill worker's [StageLoop] pulls it when its engine has a
// free slot, runs the prefill, publishes the handoff (the job plus the
// engine's kv_transfer_params) to pdq.decode.<pool>.<id>, waits for the
// PubAck, and only then acks. A decode worker pulls the handoff, runs
// generation, and relays each SSE event as a numbered chunk on the
// gateway's reply subject, ending with a terminal message.
//
// Read it after package gateway and before package workers.
package dispatcher

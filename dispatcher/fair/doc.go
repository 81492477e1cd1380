// Package fair orders the requests a pool cannot start yet: by vLLM's
// priority first, then each tenant in turn in proportion to its weight
// (start-time fair queueing), with a share of the queue per tenant so that
// one tenant's flood is refused before anyone else waits for it. The
// gateway holds its requests here, not in JetStream, whose queue is first
// in first out.
package fair

// Package queues tells a pool's workers what the pool's queues hold: how
// many jobs wait, how many pulls wait for them, how long the next one has
// waited, and which engines' consumers hold jobs their engines do not
// take.
//
// The take-over, the decode gates and the queue-depth metric all read the
// state of a pool's consumers (the shared one and one an engine with
// affinity). Each worker listing them on its own cost O(N²) in engines: N
// workers, each listing N consumers several times a second; it was most
// of what an idle fleet of 80 engines asked of JetStream
// (docs/scaling.md). Instead, one worker of the pool, its reporter, lists
// them and publishes a [Report] on dispatcher.QueuesSubject; the others
// read the last one they heard.
//
// The reporter is the publishing [Watch] whose id sorts first among those
// heard: a watch publishes while it has not heard a fresh report from an
// id before its own. So at start, and when the reporter goes, each
// publishing watch lists and publishes once or twice, then all but the
// first hear it and stop. A watch that hears no fresh report (a pool of an
// earlier build, a reporter cut off) lists the consumers itself, as every
// worker did before.
package queues

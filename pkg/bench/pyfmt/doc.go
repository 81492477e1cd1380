// Package pyfmt is what Python prints: numpy's statistics and json.dump's
// text, so that pdq bench's figures and result files agree with vLLM's
// bench serve to the last digit.
//
// It exists because Go's obvious answers differ in ways a reader of both
// tools would see: a left-to-right sum ends in other last digits than
// numpy's pairwise summation, %v and encoding/json write 1.0 as 1, and
// encoding/json refuses NaN and leaves non-ASCII text unescaped. [Mean],
// [Std], [Median] and [Percentile] are numpy's functions over the lists
// serve.py passes them; [Object], [Dumps] and [Repr] are a Python dict,
// json.dumps and a float's repr. Nothing here knows about benchmarks:
// pkg/bench decides what to compute and write.
package pyfmt

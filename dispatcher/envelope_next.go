//go:build pdqnext

package dispatcher

import "strconv"

// Built with -tags pdqnext, pdq writes its jobs one envelope version
// higher than this source defines (4 for 2, 5 for 3), each marked as
// readable as the version it stands for (HeaderReadsAs): a build as the
// next one would be. The rolling-upgrade test (tests/upgrade_test.go)
// runs it beside the plain build, one process at a time.
func init() {
	writeBody = []string{strconv.Itoa(EnvelopeParts + 1)}
	writeParts = []string{strconv.Itoa(EnvelopeParts + 2)}
}

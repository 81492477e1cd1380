package tests

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/pdq-dev/pdq/gateway"
)

// TestClientErrorCatalog holds gateway.ClientErrors, the statuses a client
// may get instead of an answer, against the README's status table (the
// same statuses, no more, no fewer), against what docs/reliability.md says
// clients get (none outside it), and against the code of the gateway,
// dispatcher and workers (no error made with a status outside it): a
// status added to one and not the others fails it.
func TestClientErrorCatalog(t *testing.T) {
	var catalog []int
	for _, e := range gateway.ClientErrors() {
		if e.Type == "" || e.Message == "" || e.When == "" || slices.Contains(catalog, e.Status) {
			t.Errorf("catalog entry %+v: want a type, a message, a when, and one entry per status", e)
		}
		catalog = append(catalog, e.Status)
	}

	readme, err := os.ReadFile(repoRoot + "/README.md")
	if err != nil {
		t.Fatal(err)
	}
	var table []int
	for _, m := range regexp.MustCompile(`(?m)^\| (\d{3}) \|`).FindAllStringSubmatch(string(readme), -1) {
		n, _ := strconv.Atoi(m[1])
		table = append(table, n)
	}
	if !slices.Equal(table, catalog) {
		t.Errorf("the README's status table has %v; the catalog %v", table, catalog)
	}

	rel, err := os.ReadFile(repoRoot + "/docs/reliability.md")
	if err != nil {
		t.Fatal(err)
	}
	section := string(rel)
	section = section[strings.Index(section, "## What a client sees"):]
	section = section[:strings.Index(section[1:], "\n## ")+1]
	for _, line := range strings.Split(section, "\n") {
		cols := strings.Split(line, "|")
		if len(cols) < 4 {
			continue
		}
		for _, s := range regexp.MustCompile(`\b[45]\d\d\b`).FindAllString(cols[2], -1) {
			if n, _ := strconv.Atoi(s); !slices.Contains(catalog, n) {
				t.Errorf("docs/reliability.md says a client gets a %d, which the catalog lacks: %s", n, strings.TrimSpace(cols[2]))
			}
		}
	}

	// The statuses the code makes errors with, by http.Status name or
	// number.
	names := map[string]int{
		"BadRequest": 400, "Unauthorized": 401, "NotFound": 404, "RequestTimeout": 408, "Conflict": 409,
		"RequestEntityTooLarge": 413, "TooManyRequests": 429, "InternalServerError": 500, "BadGateway": 502,
		"ServiceUnavailable": 503, "GatewayTimeout": 504,
	}
	made := regexp.MustCompile(`NewError\(\s*(?:http\.Status(\w+)|(\d{3}))(?:,\s*"((?:[^"\\]|\\.)*)")?`)
	messages := map[int][]string{} // the literal messages the code makes, by status
	for _, dir := range []string{"gateway", "dispatcher", "workers"} {
		err := filepath.WalkDir(filepath.Join(repoRoot, dir), func(f string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(f, ".go") || strings.HasSuffix(f, "_test.go") {
				return err
			}
			src, err := os.ReadFile(f)
			if err != nil {
				return err
			}
			for _, m := range made.FindAllStringSubmatch(string(src), -1) {
				status, known := names[m[1]]
				if m[2] != "" {
					status, _ = strconv.Atoi(m[2])
					known = true
				}
				if !known || !slices.Contains(catalog, status) {
					t.Errorf("%s makes an error with status %s%s, which the catalog lacks", f, m[1], m[2])
				}
				if msg, err := strconv.Unquote(`"` + m[3] + `"`); err == nil && m[3] != "" {
					messages[status] = append(messages[status], msg)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, e := range gateway.ClientErrors() {
		if !slices.Contains(messages[e.Status], e.Message) {
			t.Errorf("the catalog's %d message %q is made nowhere in the code; it makes %q", e.Status, e.Message, messages[e.Status])
		}
	}
}

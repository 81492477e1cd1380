package tests

import (
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestPackageMap holds docs/architecture.md's package map against the
// code: every package is in it, once; each imports only packages of a
// lower layer, so that no import points up; and its "imported by" column
// names exactly the packages that import it (test code aside, written
// "tests").
func TestPackageMap(t *testing.T) {
	doc, err := os.ReadFile(repoRoot + "/docs/architecture.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `([a-z/]+)` \\| (\\d+) \\| [^|]+ \\|([^|]*)\\|$")
	layer := map[string]int{}
	importedBy := map[string][]string{}
	for _, m := range row.FindAllStringSubmatch(string(doc), -1) {
		if _, dup := layer[m[1]]; dup {
			t.Errorf("the map lists %s twice", m[1])
		}
		layer[m[1]], _ = strconv.Atoi(m[2])
		for _, by := range strings.Split(m[3], ",") {
			if by = strings.Trim(strings.TrimSpace(by), "`"); by != "" && by != "tests" {
				importedBy[m[1]] = append(importedBy[m[1]], by)
			}
		}
	}
	if len(layer) == 0 {
		t.Fatal("no package map in docs/architecture.md")
	}

	cmd := exec.Command("go", "list", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, "./...")
	cmd.Dir = repoRoot
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	const module = "github.com/pdq-dev/pdq/"
	importers := map[string][]string{}
	seen := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Fields(line)
		pkg := strings.TrimPrefix(fields[0], module)
		l, ok := layer[pkg]
		if !ok {
			t.Errorf("package %s is not in the map", pkg)
			continue
		}
		for _, imp := range fields[1:] {
			imp, ours := strings.CutPrefix(imp, module)
			if !ours {
				continue
			}
			importers[imp] = append(importers[imp], pkg)
			if il, ok := layer[imp]; ok && il >= l {
				t.Errorf("%s (layer %d) imports %s (layer %d): an import that does not point down", pkg, l, imp, il)
			}
		}
		seen[pkg] = true
	}
	for pkg := range layer {
		if !seen[pkg] {
			t.Errorf("the map lists %s, which is no package", pkg)
		}
	}
	for pkg, want := range importedBy {
		got := importers[pkg]
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%s is imported by %v; the map says %v", pkg, got, want)
		}
	}
	for pkg, got := range importers {
		if _, listed := importedBy[pkg]; !listed {
			t.Errorf("%s is imported by %v; the map says by none", pkg, got)
		}
	}
}

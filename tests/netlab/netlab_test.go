package netlab

import (
	"fmt"
	"os"
	"strings"
	"testing"
)

// TestSweep: a new lab removes the namespaces that a killed test process
// left (its pid no longer runs), and keeps those of a process that runs
// (pid 1's, here).
func TestSweep(t *testing.T) {
	dead := 0
	for pid := 4_000_000; pid > 1_000_000; pid-- {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); os.IsNotExist(err) {
			dead = pid
			break
		}
	}
	if dead == 0 {
		t.Fatal("no pid free to stand for a killed test process")
	}
	left, kept := fmt.Sprintf("%s%d-1-x", prefix, dead), prefix+"1-1-x"
	for _, name := range []string{left, kept} {
		if out, err := run("netns", "add", name); err != nil {
			t.Fatalf("ip netns add %s: %v: %s", name, err, out)
		}
		t.Cleanup(func() { run("netns", "del", name) })
	}
	New(t)
	out, err := run("netns", "list")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(out), left) {
		t.Errorf("%s, of a process that no longer runs, was not removed", left)
	}
	if !strings.Contains(string(out), kept) {
		t.Errorf("%s, of a process that runs, was removed", kept)
	}
}

// Package netlab gives a test hosts of its own on one Linux machine: a
// network namespace a host, each joined by a veth pair to a bridge in a
// namespace of the lab's, with addresses the lab assigns. The test's own
// process joins the bridge too, so it reaches every host as a client
// would; the hosts reach nothing but each other and that address.
//
// A host is cut off by taking its link down (nothing in or out), or in
// one direction, by blackhole routes (CutFrom: it still sends, and hears
// nothing from those hosts). The machine has no tc classifiers or netem,
// and no iptables: routes and links are what the kernel gives here.
//
// Everything a lab makes is named after the test process's pid, and
// removed when the test ends, pass or fail; a lab also removes what a
// killed test process left (a pid that no longer runs).
//
// It needs root and iproute2's ip (Debian's iproute2).
package netlab

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// prefix names what labs make: namespaces "pdqlab-<pid>-<lab>-<host>" and
// links "pl<lab>h<host>" (interface names hold 15 bytes).
const prefix = "pdqlab-"

// labs numbers the labs of this process; a lab's subnet is
// 10.<77+pid%100>.<lab>.0/24, so labs of this process, and of another
// test process, do not share the test's own routes.
var labs atomic.Int32

// Lab is one test's network.
type Lab struct {
	t      testing.TB
	id     int
	name   string // namespace name prefix of this lab
	sw     string // the switch namespace
	subnet string // "10.x.y."
	mu     sync.Mutex
	hosts  []*Host
}

// Host is one of the lab's hosts.
type Host struct {
	lab  *Lab
	Name string
	// IP is its address on the lab's network.
	IP     string
	ns     string
	port   string // its veth's end in the switch namespace
	cutOff []*Host
}

// New makes a lab with its bridge, and joins the test's process to it.
// It fails the test when namespaces cannot be made (not root, no ip).
func New(t testing.TB) *Lab {
	t.Helper()
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatalf("netlab needs iproute2's ip: %v", err)
	}
	if os.Geteuid() != 0 {
		t.Fatal("netlab needs root, to make network namespaces")
	}
	sweep()
	id := int(labs.Add(1))
	pid := os.Getpid()
	l := &Lab{t: t, id: id, name: fmt.Sprintf("%s%d-%d", prefix, pid, id),
		subnet: fmt.Sprintf("10.%d.%d.", 77+pid%100, id%256)}
	l.sw = l.name + "-switch"
	t.Cleanup(l.remove)
	l.ip("netns", "add", l.sw)
	l.ip("-n", l.sw, "link", "set", "lo", "up")
	l.ip("-n", l.sw, "link", "add", "br0", "type", "bridge")
	l.ip("-n", l.sw, "link", "set", "br0", "up")
	// The test's own end: a veth from this namespace to the bridge.
	self, port := l.link("t")
	l.ip("link", "add", self, "type", "veth", "peer", "name", port, "netns", l.sw)
	l.ip("-n", l.sw, "link", "set", port, "master", "br0", "up")
	l.ip("addr", "add", l.subnet+"254/24", "dev", self)
	l.ip("link", "set", self, "up")
	return l
}

// link names the veth pair of host key: its end and the switch's.
func (l *Lab) link(key string) (string, string) {
	base := fmt.Sprintf("pl%dx%dh%s", os.Getpid()%10000, l.id, key)
	return base + "a", base + "b"
}

// Host adds a host named name (a letter or two, for its namespace's
// name) with the next address.
func (l *Lab) Host(name string) *Host {
	l.t.Helper()
	l.mu.Lock()
	n := len(l.hosts) + 1
	h := &Host{lab: l, Name: name, IP: l.subnet + strconv.Itoa(n), ns: l.name + "-" + name}
	l.hosts = append(l.hosts, h)
	l.mu.Unlock()
	end, port := l.link(strconv.Itoa(n))
	h.port = port
	l.ip("netns", "add", h.ns)
	l.ip("-n", h.ns, "link", "set", "lo", "up")
	l.ip("-n", l.sw, "link", "add", port, "type", "veth", "peer", "name", end, "netns", h.ns)
	l.ip("-n", l.sw, "link", "set", port, "master", "br0", "up")
	l.ip("-n", h.ns, "addr", "add", h.IP+"/24", "dev", end)
	l.ip("-n", h.ns, "link", "set", end, "up")
	return h
}

// Command is name run with args on the host (ip netns exec, which execs
// it: the process is name's own, for signals).
func (h *Host) Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", h.ns, name}, args...)...)
}

// Cut takes the host's link down: nothing goes in or out until Heal.
func (h *Host) Cut() {
	h.lab.t.Helper()
	h.lab.ip("-n", h.lab.sw, "link", "set", h.port, "down")
}

// CutFrom leaves the host hearing nothing from others (the test's own
// process, when self): each of them routes the host's address to a
// blackhole, and the host still sends to them. Heal ends it.
func (h *Host) CutFrom(self bool, others ...*Host) {
	h.lab.t.Helper()
	for _, o := range others {
		h.lab.ip("-n", o.ns, "route", "add", "blackhole", h.IP+"/32")
	}
	if self {
		h.lab.ip("route", "add", "blackhole", h.IP+"/32")
	}
	h.lab.mu.Lock()
	h.cutOff = append(h.cutOff, others...)
	if self {
		h.cutOff = append(h.cutOff, nil)
	}
	h.lab.mu.Unlock()
}

// Heal brings the host's link up and takes the blackholes of CutFrom
// away.
func (h *Host) Heal() {
	h.lab.t.Helper()
	h.lab.ip("-n", h.lab.sw, "link", "set", h.port, "up")
	h.lab.mu.Lock()
	cut := h.cutOff
	h.cutOff = nil
	h.lab.mu.Unlock()
	for _, o := range cut {
		if o == nil {
			h.lab.ip("route", "del", "blackhole", h.IP+"/32")
		} else {
			h.lab.ip("-n", o.ns, "route", "del", "blackhole", h.IP+"/32")
		}
	}
}

// ip runs ip with args, failing the test on an error.
func (l *Lab) ip(args ...string) {
	l.t.Helper()
	if out, err := run(args...); err != nil {
		l.t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

func run(args ...string) ([]byte, error) {
	var out bytes.Buffer
	cmd := exec.Command("ip", args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.Bytes(), err
}

// remove deletes the lab's namespaces (their veths go with them), the
// test's end of the bridge, and its blackhole routes.
func (l *Lab) remove() {
	self, _ := l.link("t")
	run("link", "del", self)
	l.mu.Lock()
	hosts := l.hosts
	l.mu.Unlock()
	for _, h := range hosts {
		for _, o := range h.cutOff {
			if o == nil {
				run("route", "del", "blackhole", h.IP+"/32")
			}
		}
		run("netns", "del", h.ns)
	}
	run("netns", "del", l.sw)
}

// sweep deletes the namespaces of labs whose test process is gone (killed
// before its cleanup ran), and their test-side veths with the switch's.
func sweep() {
	out, err := run("netns", "list")
	if err != nil {
		return
	}
	for _, line := range strings.Split(string(out), "\n") {
		name, _, _ := strings.Cut(strings.TrimSpace(line), " ")
		rest, ok := strings.CutPrefix(name, prefix)
		if !ok {
			continue
		}
		pid, err := strconv.Atoi(strings.SplitN(rest, "-", 2)[0])
		if err != nil || pid == os.Getpid() {
			continue
		}
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); err == nil {
			continue // its test still runs
		}
		run("netns", "del", name)
	}
}

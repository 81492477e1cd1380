package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// The machine is shared: a run is measured beside whatever else runs. A
// run records how much CPU the rest of the machine used meanwhile (its
// busy time, less the benchmark's own processes: this one, the engines,
// the router), so that a figure taken while something else ran shows as
// such. Busy time includes steal, the time a virtual machine's hypervisor
// gave its CPUs to others, which slows a run as much.

// clockTicks is USER_HZ, the unit of /proc's CPU times on Linux.
const clockTicks = 100

// cpuSample is the machine's busy CPU time and that of the benchmark's
// processes, in clock ticks.
type cpuSample struct {
	busy, ours float64
	ok         bool
}

// sampleCPU reads /proc/stat and the CPU times of this process and pids.
func sampleCPU(pids []int) cpuSample {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSample{}
	}
	busy, ok := machineBusy(string(b))
	if !ok {
		return cpuSample{}
	}
	s := cpuSample{busy: busy, ok: true}
	for _, pid := range append([]int{os.Getpid()}, pids...) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return cpuSample{}
		}
		t, ok := processTicks(string(b))
		if !ok {
			return cpuSample{}
		}
		s.ours += t
	}
	return s
}

// machineBusy is the busy time of all CPUs in /proc/stat's "cpu" line:
// everything but idle and iowait (steal included).
func machineBusy(stat string) (float64, bool) {
	line, _, _ := strings.Cut(stat, "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, false
	}
	var total float64
	for i, v := range f[1:] {
		n, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return 0, false
		}
		// user nice system idle iowait irq softirq steal guest
		// guest_nice: guest time is counted in user already.
		switch i {
		case 3, 4, 8, 9:
			continue
		}
		total += n
	}
	return total, true
}

// processTicks is a process's user and system time from its
// /proc/<pid>/stat.
func processTicks(stat string) (float64, bool) {
	i := strings.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(stat[i+1:])
	if len(f) < 13 {
		return 0, false
	}
	u, err1 := strconv.ParseFloat(f[11], 64)
	s, err2 := strconv.ParseFloat(f[12], 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return u + s, true
}

// otherCPU is how many CPUs the rest of the machine kept busy, on
// average, between two samples seconds apart; NaN if not known.
func otherCPU(a, b cpuSample, seconds float64) num {
	if !a.ok || !b.ok || seconds <= 0 {
		return num(nan())
	}
	other := (b.busy - a.busy) - (b.ours - a.ours)
	return num(max(other, 0) / clockTicks / seconds)
}

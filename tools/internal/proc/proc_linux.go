package proc

import (
	"os/exec"
	"syscall"
)

// setDeathSignal has the kernel kill cmd when the thread that started it
// exits, so that a tool killed mid-run leaves no engines behind.
func setDeathSignal(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}

package tests

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/pdq-dev/pdq/tests/netlab"
)

// builtBinary is a command built once per test binary, next to the pdq
// binary (removed with it when the tests end).
type builtBinary struct {
	once sync.Once
	path string
	err  error
}

// get builds the command named name with go build and args (flags, then
// the package) at its first call, and returns its path.
func (b *builtBinary) get(t *testing.T, name string, args ...string) string {
	t.Helper()
	b.once.Do(func() {
		path := filepath.Join(filepath.Dir(pdqBinary), name)
		out, err := exec.Command("go", append([]string{"build", "-o", path}, args...)...).CombinedOutput()
		if err != nil {
			b.err = fmt.Errorf("build %s: %w\n%s", name, err, out)
			return
		}
		b.path = path
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

// natsServerBin is nats-server, built from the module pdq depends on.
var natsServerBin builtBinary

func natsServerBinary(t *testing.T) string {
	t.Helper()
	return natsServerBin.get(t, "nats-server", "github.com/nats-io/nats-server/v2")
}

// natsServer is a nats-server process that a test can kill -9 and start
// again with the same configuration: the same port and the same store.
type natsServer struct {
	t    *testing.T
	name string       // its server_name
	conf string       // its configuration file
	url  string       // its client URL
	host *netlab.Host // where it runs; nil for this machine's namespace

	mu     sync.Mutex
	out    bytes.Buffer
	cmd    *exec.Cmd
	exited chan struct{}
}

// natsNode describes one server of a test's NATS: its name, client and
// route (cluster) addresses.
type natsNode struct {
	name, client, route string
}

// writeNATSConf writes a server's configuration: JetStream with file
// storage under dir, and routes to peers when it is part of a cluster.
// extra is appended as is (authorization, TLS).
func writeNATSConf(t *testing.T, dir string, n natsNode, peers []natsNode, extra string) string {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "server_name: %s\nlisten: %s\nmax_payload: 8MB\n", n.name, n.client)
	fmt.Fprintf(&b, "jetstream {\n  store_dir: %q\n  max_memory_store: 256MB\n  max_file_store: 10GB\n}\n", filepath.Join(dir, "store"))
	if len(peers) > 0 {
		fmt.Fprintf(&b, "cluster {\n  name: pdq-test\n  listen: %s\n  routes: [\n", n.route)
		for _, p := range peers {
			fmt.Fprintf(&b, "    nats-route://%s\n", p.route)
		}
		b.WriteString("  ]\n}\n")
	}
	b.WriteString(extra)
	path := filepath.Join(dir, n.name+".conf")
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// startNATSServer runs nats-server with conf; it is killed when the test
// ends. It does not wait for the server to be ready: see waitJetStream.
func startNATSServer(t *testing.T, n natsNode, conf string) *natsServer {
	t.Helper()
	return startNATSServerOn(t, nil, n, conf)
}

// startNATSServerOn is startNATSServer on one of a lab's hosts (nil: this
// machine's namespace).
func startNATSServerOn(t *testing.T, h *netlab.Host, n natsNode, conf string) *natsServer {
	t.Helper()
	s := &natsServer{t: t, name: n.name, conf: conf, url: "nats://" + n.client, host: h}
	s.start()
	t.Cleanup(func() {
		s.mu.Lock()
		cmd, exited := s.cmd, s.exited
		s.mu.Unlock()
		select {
		case <-exited:
			return
		default:
		}
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-exited
		}
	})
	return s
}

// start starts the process (again).
func (s *natsServer) start() {
	s.t.Helper()
	cmd := exec.Command(natsServerBinary(s.t), "-c", s.conf)
	if s.host != nil {
		cmd = s.host.Command(context.Background(), natsServerBinary(s.t), "-c", s.conf)
	}
	w := &lockedWriter{mu: &s.mu, w: &s.out}
	cmd.Stdout, cmd.Stderr = w, w
	dieWithTests(cmd)
	if err := cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() {
		cmd.Wait()
		close(exited)
	}()
	s.mu.Lock()
	s.cmd, s.exited = cmd, exited
	s.mu.Unlock()
}

// kill9 ends the server at once, as a crash would.
func (s *natsServer) kill9() {
	s.t.Helper()
	s.mu.Lock()
	cmd, exited := s.cmd, s.exited
	s.mu.Unlock()
	if err := cmd.Process.Kill(); err != nil {
		s.t.Fatal(err)
	}
	<-exited
}

func (s *natsServer) output() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.out.String()
}

// waitJetStream waits until JetStream answers at url (every server of a
// cluster listed, comma-separated), and returns a connection for the test's
// own look-ups, which reconnects for as long as the test runs.
func waitJetStream(t *testing.T, url string, opts ...nats.Option) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	opts = append([]nats.Option{nats.Name("pdq tests"), nats.MaxReconnects(-1), nats.ReconnectWait(100 * time.Millisecond)}, opts...)
	deadline := time.Now().Add(20 * time.Second)
	var last error
	for time.Now().Before(deadline) {
		nc, err := nats.Connect(url, opts...)
		if err == nil {
			js, err := jetstream.New(nc)
			if err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
				_, err = js.AccountInfo(ctx)
				cancel()
				if err == nil {
					t.Cleanup(nc.Close)
					return nc, js
				}
			}
			nc.Close()
		}
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("JetStream at %s not ready within 20s: %v", url, last)
	return nil, nil
}

// startClusterOn is startCluster on a NATS the test runs itself (a
// nats-server process, a cluster of them, or a server that wants
// credentials): the engines and the gateway as processes, joining natsURL.
func startClusterOn(t *testing.T, natsURL string, o clusterOptions, natsOpts ...nats.Option) *cluster {
	t.Helper()
	nc, js := waitJetStream(t, natsURL, natsOpts...)
	c := &cluster{t: t, natsURL: natsURL, nc: nc, js: js, gatewayEnv: o.gatewayEnv}
	c.env = append([]string{"PDQ_NATS_URL=" + natsURL, "PDQ_ACK_WAIT=1s"}, o.env...)
	_, c.prefill = startSimProcess(t, o.prefillSim...)
	c.decodeP, c.decode = startSimProcess(t, o.decodeSim...)
	c.startGateway()
	return c
}

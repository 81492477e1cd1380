package tests

import (
	"bytes"
	"errors"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/pdq-dev/pdq/pkg/config"
)

// composeFile is the part of docker-compose.yml that this test reads,
// strictly: a key it does not know fails the test, so that a typo in the
// file does not pass silently.
type composeFile struct {
	Name     string                    `yaml:"name"`
	Base     composeService            `yaml:"x-pdq"`
	VLLM     composeService            `yaml:"x-vllm"`
	Services map[string]composeService `yaml:"services"`
	Volumes  map[string]struct{}       `yaml:"volumes"`
	Networks map[string]struct {
		IPAM struct {
			Config []struct {
				Subnet string `yaml:"subnet"`
			} `yaml:"config"`
		} `yaml:"ipam"`
	} `yaml:"networks"`
}

type composeService struct {
	Image string `yaml:"image"`
	Build *struct {
		Context    string            `yaml:"context"`
		Dockerfile string            `yaml:"dockerfile"`
		Args       map[string]string `yaml:"args"`
	} `yaml:"build"`
	Command     []string                     `yaml:"command"`
	Environment map[string]string            `yaml:"environment"`
	Ports       []string                     `yaml:"ports"`
	Volumes     []string                     `yaml:"volumes"`
	Profiles    []string                     `yaml:"profiles"`
	DependsOn   map[string]composeDependency `yaml:"depends_on"`
	Restart     string                       `yaml:"restart"`
	StopGrace   string                       `yaml:"stop_grace_period"`
	IPC         string                       `yaml:"ipc"`
	WorkingDir  string                       `yaml:"working_dir"`
	Deploy      *struct {
		Resources struct {
			Reservations struct {
				Devices []struct {
					Driver       string   `yaml:"driver"`
					Count        any      `yaml:"count"`
					DeviceIDs    []string `yaml:"device_ids"`
					Capabilities []string `yaml:"capabilities"`
				} `yaml:"devices"`
			} `yaml:"reservations"`
		} `yaml:"resources"`
	} `yaml:"deploy"`
	Networks map[string]struct {
		IPv4Address string `yaml:"ipv4_address"`
	} `yaml:"networks"`
	Healthcheck *struct {
		Test        []string `yaml:"test"`
		Interval    string   `yaml:"interval"`
		Timeout     string   `yaml:"timeout"`
		Retries     int      `yaml:"retries"`
		StartPeriod string   `yaml:"start_period"`
	} `yaml:"healthcheck"`
}

// composeDependency is one entry of a service's depends_on, in the long
// form (the only one the file uses, so that it decodes strictly).
type composeDependency struct {
	Condition string `yaml:"condition"`
	Required  *bool  `yaml:"required"`
}

// composeVar is a Compose interpolation: ${NAME}, ${NAME:-default} or
// ${NAME-default}.
var composeVar = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}`)

// composeDefault is s as Compose reads it with none of its variables set.
func composeDefault(s string) string {
	return composeVar.ReplaceAllString(s, "$2")
}

func readCompose(t *testing.T) composeFile {
	t.Helper()
	raw, err := os.ReadFile(repoRoot + "/docker-compose.yml")
	if err != nil {
		t.Fatal(err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	var f composeFile
	if err := dec.Decode(&f); err != nil {
		t.Fatalf("docker-compose.yml: %v", err)
	}
	return f
}

// TestComposeFile checks docker-compose.yml and deploy/Dockerfile without
// a Docker engine (this machine has none): every PDQ_ variable they set is
// one pdq reads, every pdq command and its flags are real, the workers
// scale, and the image is built from the binary's package, not as root.
func TestComposeFile(t *testing.T) {
	f := readCompose(t)
	known, err := config.Names()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"nats", "gateway", "prefill", "decode", "prefill-engine", "decode-engine", "vllm-prefill", "vllm-decode"} {
		if _, ok := f.Services[want]; !ok {
			t.Errorf("no service %s", want)
		}
	}
	for name, s := range f.Services {
		for key := range s.Environment {
			if strings.HasPrefix(key, "PDQ_") && !slices.Contains(known, key) {
				t.Errorf("service %s sets %s, which pdq does not read", name, key)
			}
		}
		if s.Image == "pdq:local" {
			pdqCommand(t, name, s.Command)
			if s.Build == nil || s.Build.Dockerfile != "deploy/Dockerfile" {
				t.Errorf("service %s runs pdq:local without building deploy/Dockerfile", name)
			} else if s.Build.Args["REVISION"] == "" {
				t.Errorf("service %s builds pdq:local without the REVISION its version names", name)
			}
		}
		if h := s.Healthcheck; h != nil && len(h.Test) > 2 && h.Test[1] == "/pdq" {
			pdqCommand(t, name+" health check", h.Test[2:])
		}
		if s.Healthcheck == nil && (name == "gateway" || name == "nats") {
			t.Errorf("service %s has no health check", name)
		}
		if s.Restart == "" {
			t.Errorf("service %s has no restart policy", name)
		}
		for _, v := range s.Volumes {
			if src, _, _ := strings.Cut(v, ":"); strings.HasPrefix(src, "./") {
				if _, err := os.Stat("../" + src); err != nil {
					t.Errorf("service %s mounts %s: %v", name, src, err)
				}
			}
		}
	}
	for _, scaled := range []string{"prefill", "decode"} {
		if s := f.Services[scaled]; len(s.Ports) > 0 {
			t.Errorf("service %s publishes ports, so docker compose up --scale %s=3 fails", scaled, scaled)
		}
	}
	for _, gpu := range []string{"vllm-prefill", "vllm-decode"} {
		s := f.Services[gpu]
		ip := s.Networks["default"].IPv4Address
		if !slices.Contains(s.Profiles, "gpu") || !strings.Contains(strings.Join(s.Command, " "), `"kv_connector":"NixlConnector","kv_role":"kv_both"`) ||
			ip == "" || s.Environment["VLLM_NIXL_SIDE_CHANNEL_HOST"] != ip {
			t.Errorf("service %s: want profile gpu, NixlConnector with kv_both, and its own fixed address as the side-channel host", gpu)
		}
	}

	docker, err := os.ReadFile(repoRoot + "/deploy/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"./cmd/pdq", "CGO_ENABLED=0", "USER 65532:65532", `ENTRYPOINT ["/pdq"]`} {
		if !strings.Contains(string(docker), want) {
			t.Errorf("deploy/Dockerfile lacks %q", want)
		}
	}
}

// pdqCommand checks that args (without the binary) are a pdq command line
// that pdq accepts: with -h appended, pdq parses the flags, prints the
// command's usage and exits 0; an unknown command or flag exits 2.
func pdqCommand(t *testing.T, where string, args []string) {
	t.Helper()
	if len(args) == 0 {
		t.Errorf("%s: no command", where)
		return
	}
	if args[0] == "probe" {
		// Its URL is an argument, which ends the flags: -h after it is
		// not read. Asked of a port nobody listens on, a good command line
		// fails as a probe (exit 1), a bad one as a usage error (exit 2).
		line := append(slices.Clone(args[:len(args)-1]), "--timeout", "500ms", "http://127.0.0.1:1/ready")
		out, err := exec.Command(pdqBinary, line...).CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(string(out), "probe:") {
			t.Errorf("%s: pdq %s is not a pdq command line: %v\n%s", where, strings.Join(args, " "), err, out)
		}
		return
	}
	out, err := exec.Command(pdqBinary, append(slices.Clone(args), "-h")...).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "pdq "+args[0]) {
		t.Errorf("%s: pdq %s is not a pdq command line: %v\n%s", where, strings.Join(args, " "), err, out)
	}
}

// TestComposeStartOrder checks that docker compose starts each service once
// what it needs answers: every service has a health check, the workers wait
// for NATS and for the engines they may be pointed at (the simulated one,
// and vLLM with the gpu profile) to be healthy, and each health check asks
// the service's own health endpoint.
func TestComposeStartOrder(t *testing.T) {
	f := readCompose(t)
	for name, s := range f.Services {
		if s.Healthcheck == nil || len(s.Healthcheck.Test) < 2 {
			t.Errorf("service %s has no health check", name)
		}
		for dep, d := range s.DependsOn {
			other, ok := f.Services[dep]
			if !ok {
				t.Errorf("service %s depends on %s, which is no service", name, dep)
				continue
			}
			if d.Condition == "service_healthy" && other.Healthcheck == nil {
				t.Errorf("service %s waits for %s to be healthy, which has no health check", name, dep)
			}
			// A dependency that a profile may leave out must not be
			// required, or Compose refuses to start without the profile.
			if missing := slices.ContainsFunc(other.Profiles, func(p string) bool { return !slices.Contains(s.Profiles, p) }); missing && len(other.Profiles) > 0 &&
				(d.Required == nil || *d.Required) {
				t.Errorf("service %s depends on %s (profiles %v) without required: false", name, dep, other.Profiles)
			}
		}
	}
	for _, stage := range []string{"prefill", "decode"} {
		s := f.Services[stage]
		engine, err := url.Parse(composeDefault(s.Environment["PDQ_ENGINE_URL"]))
		if err != nil || engine.Hostname() == "" {
			t.Errorf("service %s: PDQ_ENGINE_URL %q", stage, s.Environment["PDQ_ENGINE_URL"])
			continue
		}
		for _, dep := range []string{"nats", engine.Hostname(), "vllm-" + stage} {
			if s.DependsOn[dep].Condition != "service_healthy" {
				t.Errorf("service %s starts before %s is healthy", stage, dep)
			}
		}
		_, port, _ := net.SplitHostPort(s.Environment["PDQ_METRICS_ADDR"])
		if h := s.Healthcheck; h == nil || !slices.Equal(h.Test, []string{"CMD", "/pdq", "probe", "http://127.0.0.1:" + port + "/ready"}) {
			t.Errorf("service %s: want a health check that probes /ready on PDQ_METRICS_ADDR (port %q)", stage, port)
		}
	}
	for _, name := range []string{"vllm-prefill", "vllm-decode"} {
		s := f.Services[name]
		i := slices.Index(s.Command, "--port")
		if i < 0 || i+1 >= len(s.Command) {
			t.Errorf("service %s: no --port", name)
			continue
		}
		if h := s.Healthcheck; h == nil || !strings.Contains(strings.Join(h.Test, " "), "http://127.0.0.1:"+s.Command[i+1]+"/health") || h.StartPeriod == "" {
			t.Errorf("service %s: want a health check on vLLM's /health (port %s) with a start period for the model's load", name, s.Command[i+1])
		}
	}
}

// TestComposeGPUs checks that the two vLLM engines reserve a GPU each, and
// not the same one: "count: 1" gives every service the first GPU, so only
// distinct device_ids keep them apart.
func TestComposeGPUs(t *testing.T) {
	f := readCompose(t)
	seen := map[string]string{}
	for _, name := range []string{"vllm-prefill", "vllm-decode"} {
		s := f.Services[name]
		if s.Deploy == nil || len(s.Deploy.Resources.Reservations.Devices) != 1 {
			t.Errorf("service %s: want one device reservation", name)
			continue
		}
		d := s.Deploy.Resources.Reservations.Devices[0]
		if d.Driver != "nvidia" || !slices.Contains(d.Capabilities, "gpu") {
			t.Errorf("service %s: want an nvidia gpu reservation, got %+v", name, d)
		}
		if d.Count != nil || len(d.DeviceIDs) == 0 {
			t.Errorf("service %s: reserves count %v, device_ids %v; want device_ids, without count", name, d.Count, d.DeviceIDs)
		}
		for _, id := range d.DeviceIDs {
			id = composeDefault(id)
			if other, ok := seen[id]; ok {
				t.Errorf("services %s and %s both reserve GPU %s", other, name, id)
			}
			seen[id] = name
		}
	}
}

// TestImageVersion: the image is built without .git, so its build stamps
// no VCS information; the Dockerfile's REVISION argument, through the
// linker flag it gives, is what pdq version and pdq_build_info name. This
// builds pdq with that flag as the Dockerfile writes it.
func TestImageVersion(t *testing.T) {
	docker, err := os.ReadFile(repoRoot + "/deploy/Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	flag := regexp.MustCompile(`-X main\.\w+=\$\{REVISION\}`).Find(docker)
	if flag == nil || !strings.Contains(string(docker), "ARG REVISION") {
		t.Fatalf("deploy/Dockerfile stamps no REVISION into the binary:\n%s", docker)
	}
	const rev = "0123456789abcdef0123456789abcdef01234567"
	bin := filepath.Join(t.TempDir(), "pdq")
	build := exec.Command("go", "build", "-buildvcs=false", "-ldflags", strings.ReplaceAll(string(flag), "${REVISION}", rev), "-o", bin, "./cmd/pdq")
	build.Dir = repoRoot
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	if out, err := exec.Command(bin, "version").Output(); err != nil || !strings.Contains(string(out), "commit "+rev[:12]) {
		t.Errorf("pdq version of an image build: %v %q, want commit %s", err, out, rev[:12])
	}
}

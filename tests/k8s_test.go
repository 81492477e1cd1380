package tests

import (
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/pkg/config"
)

// scaledObject is the part of KEDA's ScaledObject (keda.sh/v1alpha1) that
// the manifests use, decoded strictly like the Kubernetes types: KEDA's own
// Go module would pull in a controller runtime for one type.
type scaledObject struct {
	metav1.TypeMeta `json:",inline"`
	Metadata        metav1.ObjectMeta `json:"metadata"`
	Spec            struct {
		ScaleTargetRef struct {
			Name string `json:"name"`
		} `json:"scaleTargetRef"`
		MinReplicaCount *int32        `json:"minReplicaCount,omitempty"`
		MaxReplicaCount *int32        `json:"maxReplicaCount,omitempty"`
		CooldownPeriod  *int32        `json:"cooldownPeriod,omitempty"`
		Triggers        []kedaTrigger `json:"triggers"`
	} `json:"spec"`
}

// kedaTrigger is one trigger of a ScaledObject.
type kedaTrigger struct {
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata"`
}

// manifests holds every object of deploy/k8s, by kind.
type manifests struct {
	deployments []appsv1.Deployment
	services    []corev1.Service
	pdbs        []policyv1.PodDisruptionBudget
	scaled      []scaledObject
}

func readManifests(t *testing.T) manifests {
	t.Helper()
	files, err := filepath.Glob("../deploy/k8s/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in deploy/k8s: %v", err)
	}
	var m manifests
	sep := regexp.MustCompile(`(?m)^---\s*$`)
	for _, file := range files {
		raw, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		if filepath.Base(file) == "nats-values.yaml" {
			var values map[string]any // Helm values: checked below
			if err := yaml.Unmarshal(raw, &values); err != nil {
				t.Errorf("%s: %v", file, err)
			}
			continue
		}
		for i, doc := range sep.Split(string(raw), -1) {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			var tm metav1.TypeMeta
			if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
				t.Fatalf("%s, document %d: %v", file, i+1, err)
			}
			var obj any
			switch tm.APIVersion + " " + tm.Kind {
			case "apps/v1 Deployment":
				m.deployments = append(m.deployments, appsv1.Deployment{})
				obj = &m.deployments[len(m.deployments)-1]
			case "v1 Service":
				m.services = append(m.services, corev1.Service{})
				obj = &m.services[len(m.services)-1]
			case "policy/v1 PodDisruptionBudget":
				m.pdbs = append(m.pdbs, policyv1.PodDisruptionBudget{})
				obj = &m.pdbs[len(m.pdbs)-1]
			case "keda.sh/v1alpha1 ScaledObject":
				m.scaled = append(m.scaled, scaledObject{})
				obj = &m.scaled[len(m.scaled)-1]
			default:
				t.Errorf("%s, document %d: unexpected %s %s", file, i+1, tm.APIVersion, tm.Kind)
				continue
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Errorf("%s, document %d (%s): %v", file, i+1, tm.Kind, err)
			}
		}
	}
	return m
}

func stripComments(doc string) string {
	var b strings.Builder
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line + "\n")
		}
	}
	return b.String()
}

// TestKubernetesManifests decodes every manifest of deploy/k8s strictly
// into the Kubernetes API types (an unknown field fails), and checks what
// running pdq on them needs: real pdq command lines and variables, probes
// on /health and /ready, a termination grace longer than pdq's 30 s, a
// disruption budget for every Deployment, KEDA scaling of every worker
// pool, and of the engines it calls through a Service, on the consumer its
// workers share, and NIXL set up on the engines.
func TestKubernetesManifests(t *testing.T) {
	m := readManifests(t)
	known, err := config.Names()
	if err != nil {
		t.Fatal(err)
	}
	values, err := os.ReadFile("../deploy/k8s/nats-values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Config struct {
			Cluster struct {
				Enabled  bool `json:"enabled"`
				Replicas int  `json:"replicas"`
			} `json:"cluster"`
			JetStream struct {
				Enabled   bool `json:"enabled"`
				FileStore struct {
					PVC struct {
						Size string `json:"size"`
					} `json:"pvc"`
				} `json:"fileStore"`
			} `json:"jetstream"`
			Merge struct {
				MaxPayload int `json:"max_payload"`
			} `json:"merge"`
			Monitor struct {
				Enabled bool `json:"enabled"`
			} `json:"monitor"`
		} `json:"config"`
		Service struct {
			Ports struct {
				Monitor struct {
					Enabled bool `json:"enabled"`
				} `json:"monitor"`
			} `json:"ports"`
		} `json:"service"`
	}
	if err := yaml.UnmarshalStrict(values, &v); err != nil {
		t.Errorf("nats-values.yaml: %v", err)
	}
	if c := v.Config; !c.Cluster.Enabled || c.Cluster.Replicas != 3 || !c.JetStream.Enabled || c.JetStream.FileStore.PVC.Size == "" ||
		c.Merge.MaxPayload != 8<<20 || !c.Monitor.Enabled || !v.Service.Ports.Monitor.Enabled {
		t.Errorf("nats-values.yaml: %+v; want a 3-node cluster, JetStream on volumes, 8 MiB payloads, monitoring on the Service", v)
	}

	var model string
	for _, d := range m.deployments {
		for _, c := range d.Spec.Template.Spec.Containers {
			if i := slices.Index(c.Args, "--model"); strings.HasPrefix(c.Image, "vllm/") && i >= 0 && i+1 < len(c.Args) {
				model = c.Args[i+1]
				if c.StartupProbe == nil || c.LivenessProbe == nil || c.ReadinessProbe == nil {
					t.Errorf("%s: vLLM wants startup, liveness and readiness probes", d.Name)
				}
				if !strings.Contains(strings.Join(c.Args, " "), `"kv_connector":"NixlConnector","kv_role":"kv_both"`) {
					t.Errorf("%s: vLLM without NixlConnector and kv_both", d.Name)
				}
				if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool {
					return e.Name == "VLLM_NIXL_SIDE_CHANNEL_HOST" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil &&
						e.ValueFrom.FieldRef.FieldPath == "status.podIP"
				}) {
					t.Errorf("%s: the NIXL side channel must be advertised on the pod's IP", d.Name)
				}
			}
		}
	}
	if model == "" {
		t.Fatal("no vLLM Deployment with --model")
	}
	pool := dispatcher.PoolName(model)

	workers := map[dispatcher.Stage]string{} // stage -> the Deployment that runs its workers
	engines := map[dispatcher.Stage]string{} // stage -> its workers' PDQ_ENGINE_URL
	for _, d := range m.deployments {
		spec := d.Spec.Template.Spec
		for _, c := range spec.Containers {
			if c.Image != "pdq:local" {
				continue
			}
			pdqCommand(t, d.Name+"/"+c.Name, c.Args)
			for _, e := range c.Env {
				if strings.HasPrefix(e.Name, "PDQ_") && !slices.Contains(known, e.Name) {
					t.Errorf("%s/%s sets %s, which pdq does not read", d.Name, c.Name, e.Name)
				}
			}
			grace := 30 * time.Second // PDQ_SHUTDOWN_GRACE's default
			for _, e := range c.Env {
				if e.Name == "PDQ_SHUTDOWN_GRACE" {
					if grace, err = time.ParseDuration(e.Value); err != nil {
						t.Errorf("%s/%s: PDQ_SHUTDOWN_GRACE: %v", d.Name, c.Name, err)
					}
				}
			}
			if g := spec.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second < grace+10*time.Second {
				t.Errorf("%s: terminationGracePeriodSeconds %v, want at least pdq's shutdown grace (%v) and 10 s", d.Name, g, grace)
			}
			for _, other := range spec.Containers {
				// An engine beside its worker must outlive the worker's grace.
				if !strings.HasPrefix(other.Image, "vllm/") {
					continue
				}
				sleep := 0
				if l := other.Lifecycle; l != nil && l.PreStop != nil && l.PreStop.Exec != nil && len(l.PreStop.Exec.Command) == 2 &&
					l.PreStop.Exec.Command[0] == "sleep" {
					sleep, _ = strconv.Atoi(l.PreStop.Exec.Command[1])
				}
				if time.Duration(sleep)*time.Second < grace {
					t.Errorf("%s: the vLLM container beside %s sleeps %d s before it stops, want at least its %v grace", d.Name, c.Name, sleep, grace)
				}
			}
			if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/ready" ||
				c.LivenessProbe == nil || c.LivenessProbe.HTTPGet == nil || c.LivenessProbe.HTTPGet.Path != "/health" {
				t.Errorf("%s/%s: want readiness on /ready and liveness on /health", d.Name, c.Name)
			}
			if stage := dispatcher.Stage(c.Args[0]); stage == dispatcher.StagePrefill || stage == dispatcher.StageDecode {
				workers[stage] = d.Name
				for _, e := range c.Env {
					if e.Name == "PDQ_ENGINE_URL" {
						engines[stage] = e.Value
					}
				}
				if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "PDQ_METRICS_ADDR" }) {
					t.Errorf("%s/%s: a worker serves its probes on PDQ_METRICS_ADDR, which is not set", d.Name, c.Name)
				}
			}
		}
		if !slices.ContainsFunc(m.pdbs, func(p policyv1.PodDisruptionBudget) bool {
			sel, err := metav1.LabelSelectorAsSelector(p.Spec.Selector)
			return err == nil && sel.Matches(labels.Set(d.Spec.Template.Labels))
		}) {
			t.Errorf("%s: no PodDisruptionBudget selects its pods", d.Name)
		}
	}
	for _, s := range m.services {
		if !slices.ContainsFunc(m.deployments, func(d appsv1.Deployment) bool {
			return labels.SelectorFromSet(s.Spec.Selector).Matches(labels.Set(d.Spec.Template.Labels))
		}) {
			t.Errorf("service %s selects no Deployment's pods", s.Name)
		}
	}
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		worker, ok := workers[stage]
		if !ok {
			t.Errorf("no Deployment runs %s workers", stage)
			continue
		}
		// The workers scale on their consumer's lag, and so do the engines
		// they call when those run in a Deployment of their own (behind a
		// Service), as the prefill engines do.
		targets := []string{worker}
		engine, err := url.Parse(engines[stage])
		if err != nil || engine.Hostname() == "" {
			t.Errorf("%s: PDQ_ENGINE_URL %q is not an engine URL", worker, engines[stage])
			continue
		}
		if host := engine.Hostname(); host != "127.0.0.1" && host != "localhost" {
			// A Service's name, maybe with its namespace and domain.
			name, _, _ := strings.Cut(host, ".")
			i := slices.IndexFunc(m.services, func(s corev1.Service) bool { return s.Name == name })
			if i < 0 {
				t.Errorf("%s: PDQ_ENGINE_URL %s names no Service", worker, engine)
				continue
			}
			var vllm []string
			for _, d := range m.deployments {
				if labels.SelectorFromSet(m.services[i].Spec.Selector).Matches(labels.Set(d.Spec.Template.Labels)) &&
					slices.ContainsFunc(d.Spec.Template.Spec.Containers, func(c corev1.Container) bool { return strings.HasPrefix(c.Image, "vllm/") }) {
					vllm = append(vllm, d.Name)
				}
			}
			if len(vllm) == 0 {
				t.Errorf("%s: the Service %s of its PDQ_ENGINE_URL selects no vLLM Deployment", worker, name)
			}
			targets = append(targets, vllm...)
		}
		stream := map[dispatcher.Stage]string{dispatcher.StagePrefill: dispatcher.StreamPrefill, dispatcher.StageDecode: dispatcher.StreamDecode}[stage]
		consumer := dispatcher.ConsumerName(stage, pool)
		for _, target := range targets {
			if !slices.ContainsFunc(m.scaled, func(so scaledObject) bool {
				return so.Spec.ScaleTargetRef.Name == target && slices.ContainsFunc(so.Spec.Triggers, func(tr kedaTrigger) bool {
					return tr.Type == "nats-jetstream" && tr.Metadata["stream"] == stream &&
						tr.Metadata["consumer"] == consumer && tr.Metadata["lagThreshold"] != ""
				})
			}) {
				t.Errorf("no ScaledObject scales %s on stream %s, consumer %s", target, stream, consumer)
			}
		}
	}
}

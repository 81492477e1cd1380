package tests

import (
	"errors"
	"fmt"
	"net"
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
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
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
		MinReplicaCount *int32 `json:"minReplicaCount,omitempty"`
		MaxReplicaCount *int32 `json:"maxReplicaCount,omitempty"`
		CooldownPeriod  *int32 `json:"cooldownPeriod,omitempty"`
		Advanced        *struct {
			HorizontalPodAutoscalerConfig struct {
				Behavior *autoscalingv2.HorizontalPodAutoscalerBehavior `json:"behavior,omitempty"`
			} `json:"horizontalPodAutoscalerConfig"`
		} `json:"advanced,omitempty"`
		Triggers []kedaTrigger `json:"triggers"`
	} `json:"spec"`
}

// podMonitor is the part of the Prometheus Operator's PodMonitor
// (monitoring.coreos.com/v1) that the manifests use, decoded strictly.
type podMonitor struct {
	metav1.TypeMeta `json:",inline"`
	Metadata        metav1.ObjectMeta `json:"metadata"`
	Spec            struct {
		Selector            metav1.LabelSelector `json:"selector"`
		PodMetricsEndpoints []podMetricsEndpoint `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

// podMetricsEndpoint is one endpoint of a PodMonitor.
type podMetricsEndpoint struct {
	Port     string `json:"port"`
	Path     string `json:"path"`
	Interval string `json:"interval,omitempty"`
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
	pvcs        []corev1.PersistentVolumeClaim
	scaled      []scaledObject
	monitors    []podMonitor
	// comments holds the comment lines of each object's document, by
	// kind and name ("PodDisruptionBudget/vllm-decode").
	comments map[string]string
}

// repoRoot is where the tests read the deploy files from: the repository.
const repoRoot = ".."

func readManifests(t *testing.T) manifests {
	t.Helper()
	files, err := filepath.Glob(repoRoot + "/deploy/k8s/*.yaml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests in deploy/k8s: %v", err)
	}
	m := manifests{comments: map[string]string{}}
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
			case "v1 PersistentVolumeClaim":
				m.pvcs = append(m.pvcs, corev1.PersistentVolumeClaim{})
				obj = &m.pvcs[len(m.pvcs)-1]
			case "keda.sh/v1alpha1 ScaledObject":
				m.scaled = append(m.scaled, scaledObject{})
				obj = &m.scaled[len(m.scaled)-1]
			case "monitoring.coreos.com/v1 PodMonitor":
				m.monitors = append(m.monitors, podMonitor{})
				obj = &m.monitors[len(m.monitors)-1]
			default:
				t.Errorf("%s, document %d: unexpected %s %s", file, i+1, tm.APIVersion, tm.Kind)
				continue
			}
			if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
				t.Errorf("%s, document %d (%s): %v", file, i+1, tm.Kind, err)
			}
			var meta struct {
				Metadata metav1.ObjectMeta `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(doc), &meta); err == nil {
				m.comments[tm.Kind+"/"+meta.Metadata.Name] = comments(doc)
			}
		}
	}
	return m
}

// natsValues is the part of nats-values.yaml (values for the NATS Helm
// chart) that the tests read, strictly.
type natsValues struct {
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
			Port    int  `json:"port,omitempty"`
		} `json:"monitor"`
	} `json:"config"`
	Container struct {
		Image struct {
			Tag string `json:"tag"`
		} `json:"image"`
	} `json:"container"`
	Service struct {
		Ports struct {
			Monitor struct {
				Enabled bool `json:"enabled"`
			} `json:"monitor"`
		} `json:"ports"`
	} `json:"service"`
	// raw is the file's text, comments included.
	raw string
}

func readNATSValues(t *testing.T) natsValues {
	t.Helper()
	raw, err := os.ReadFile(repoRoot + "/deploy/k8s/nats-values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var v natsValues
	if err := yaml.UnmarshalStrict(raw, &v); err != nil {
		t.Errorf("nats-values.yaml: %v", err)
	}
	v.raw = string(raw)
	return v
}

// servedModel is the model name a vLLM container serves: its first
// --served-model-name, or else its --model.
func servedModel(c corev1.Container) string {
	for _, flag := range []string{"--served-model-name", "--model"} {
		if i := slices.Index(c.Args, flag); i >= 0 && i+1 < len(c.Args) {
			return c.Args[i+1]
		}
	}
	return ""
}

// servedModelOf is the one model the vLLM Deployments of m serve.
func servedModelOf(t *testing.T, m manifests) string {
	t.Helper()
	var model string
	for _, d := range m.deployments {
		for _, c := range d.Spec.Template.Spec.Containers {
			if served := servedModel(c); strings.HasPrefix(c.Image, "vllm/") && served != "" {
				if model != "" && served != model {
					t.Errorf("%s: vLLM serves %q, another Deployment %q: the manifests are written for one model", d.Name, served, model)
				}
				model = served
			}
		}
	}
	if model == "" {
		t.Fatal("no vLLM Deployment with --model")
	}
	return model
}

// comments returns the comment lines of doc, without their '#'.
func comments(doc string) string {
	var b strings.Builder
	for _, line := range strings.Split(doc, "\n") {
		if c, ok := strings.CutPrefix(strings.TrimSpace(line), "#"); ok {
			b.WriteString(strings.TrimSpace(c) + "\n")
		}
	}
	return b.String()
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
	v := readNATSValues(t)
	if c := v.Config; !c.Cluster.Enabled || c.Cluster.Replicas != 3 || !c.JetStream.Enabled || c.JetStream.FileStore.PVC.Size == "" ||
		c.Merge.MaxPayload != 8<<20 || !c.Monitor.Enabled || !v.Service.Ports.Monitor.Enabled {
		t.Errorf("nats-values.yaml: %+v; want a 3-node cluster, JetStream on volumes, 8 MiB payloads, monitoring on the Service", v)
	}

	model := servedModelOf(t, m)
	for _, d := range m.deployments {
		for _, c := range d.Spec.Template.Spec.Containers {
			if strings.HasPrefix(c.Image, "vllm/") {
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

// isPdq reports whether c runs the pdq image.
func isPdq(c corev1.Container) bool { return c.Image == "pdq:local" }

// isVLLM reports whether c runs a vLLM image.
func isVLLM(c corev1.Container) bool { return strings.HasPrefix(c.Image, "vllm/") }

// env is the value of the variable name in c, set literally.
func env(c corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

// TestKubernetesPdqSecurity checks that every pdq container runs with the
// restricted Pod Security settings: not root, a read-only root file system
// (pdq writes no file at run time), no privilege escalation, no
// capabilities, and the runtime's default seccomp profile; a container's
// settings may come from its pod where Kubernetes allows it.
func TestKubernetesPdqSecurity(t *testing.T) {
	m := readManifests(t)
	n := 0
	for _, d := range m.deployments {
		pod := d.Spec.Template.Spec.SecurityContext
		if pod == nil {
			pod = &corev1.PodSecurityContext{}
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			if !isPdq(c) {
				continue
			}
			n++
			sc := c.SecurityContext
			if sc == nil {
				sc = &corev1.SecurityContext{}
			}
			nonRoot := sc.RunAsNonRoot
			if nonRoot == nil {
				nonRoot = pod.RunAsNonRoot
			}
			seccomp := sc.SeccompProfile
			if seccomp == nil {
				seccomp = pod.SeccompProfile
			}
			where := d.Name + "/" + c.Name
			if nonRoot == nil || !*nonRoot {
				t.Errorf("%s: runAsNonRoot is not set", where)
			}
			if sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
				t.Errorf("%s: want readOnlyRootFilesystem: true", where)
			}
			if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
				t.Errorf("%s: want allowPrivilegeEscalation: false", where)
			}
			if sc.Capabilities == nil || !slices.Contains(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) > 0 {
				t.Errorf("%s: want capabilities {drop: [ALL]} and none added", where)
			}
			if seccomp == nil || seccomp.Type != corev1.SeccompProfileTypeRuntimeDefault {
				t.Errorf("%s: want the RuntimeDefault seccomp profile", where)
			}
			if sc.Privileged != nil && *sc.Privileged {
				t.Errorf("%s: privileged", where)
			}
		}
	}
	if n < 3 {
		t.Errorf("%d pdq containers, want the gateway and the two workers", n)
	}
}

// TestKubernetesEngines checks what a vLLM pod needs beyond its GPU: CPU
// and memory requests (a pod with a GPU limit only is scheduled as if it
// needed no memory, and loading a model takes gigabytes of it), a
// memory-backed /dev/shm (64 MiB by default, too small for PyTorch), the
// Hugging Face cache on a volume every replica can mount, and a token from
// a Secret for gated models.
func TestKubernetesEngines(t *testing.T) {
	m := readManifests(t)
	n := 0
	for _, d := range m.deployments {
		spec := d.Spec.Template.Spec
		volumes := map[string]corev1.Volume{}
		for _, v := range spec.Volumes {
			volumes[v.Name] = v
		}
		for _, c := range spec.Containers {
			if !isVLLM(c) {
				continue
			}
			n++
			where := d.Name + "/" + c.Name
			req := c.Resources.Requests
			if req.Cpu().IsZero() || req.Memory().IsZero() {
				t.Errorf("%s: requests %v; want CPU and memory requests", where, req)
			}
			if gpu := c.Resources.Limits[corev1.ResourceName("nvidia.com/gpu")]; gpu.IsZero() {
				t.Errorf("%s: no nvidia.com/gpu limit", where)
			}
			mounts := map[string]corev1.Volume{}
			for _, vm := range c.VolumeMounts {
				v, ok := volumes[vm.Name]
				if !ok {
					t.Errorf("%s: mounts %s, which the pod does not have", where, vm.Name)
				}
				mounts[vm.MountPath] = v
			}
			if v, ok := mounts["/dev/shm"]; !ok || v.EmptyDir == nil || v.EmptyDir.Medium != corev1.StorageMediumMemory {
				t.Errorf("%s: want an emptyDir of medium Memory on /dev/shm", where)
			}
			if v, ok := mounts["/root/.cache/huggingface"]; !ok || v.PersistentVolumeClaim == nil {
				t.Errorf("%s: want a PersistentVolumeClaim on /root/.cache/huggingface, the model cache", where)
			} else {
				name := v.PersistentVolumeClaim.ClaimName
				i := slices.IndexFunc(m.pvcs, func(p corev1.PersistentVolumeClaim) bool { return p.Name == name })
				// Every replica of the pool, and the other pool, mount it.
				if i < 0 || !slices.Contains(m.pvcs[i].Spec.AccessModes, corev1.ReadWriteMany) {
					t.Errorf("%s: the model cache claim %s is not a ReadWriteMany PersistentVolumeClaim of deploy/k8s", where, name)
				}
			}
			if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool {
				return e.Name == "HF_TOKEN" && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && e.ValueFrom.SecretKeyRef.Name != ""
			}) {
				t.Errorf("%s: want HF_TOKEN from a Secret", where)
			}
		}
	}
	if n < 2 {
		t.Errorf("%d vLLM containers, want the prefill and the decode engines", n)
	}
}

// minReplicas is the fewest pods d runs: its ScaledObject's minimum, or
// else its replicas.
func minReplicas(m manifests, d appsv1.Deployment) int {
	for _, so := range m.scaled {
		if so.Spec.ScaleTargetRef.Name == d.Name {
			if so.Spec.MinReplicaCount == nil {
				return 0 // KEDA's default
			}
			return int(*so.Spec.MinReplicaCount)
		}
	}
	if d.Spec.Replicas == nil {
		return 1
	}
	return int(*d.Spec.Replicas)
}

// TestKubernetesDisruptionBudgets checks each PodDisruptionBudget at its
// pool's fewest pods: it must let a drain take a pod (one that allows none
// blocks node drains for good), and one that lets every pod go protects
// nothing, which its comment must say.
func TestKubernetesDisruptionBudgets(t *testing.T) {
	m := readManifests(t)
	for _, p := range m.pdbs {
		sel, err := metav1.LabelSelectorAsSelector(p.Spec.Selector)
		if err != nil {
			t.Errorf("%s: %v", p.Name, err)
			continue
		}
		i := slices.IndexFunc(m.deployments, func(d appsv1.Deployment) bool { return sel.Matches(labels.Set(d.Spec.Template.Labels)) })
		if i < 0 {
			t.Errorf("PodDisruptionBudget %s selects no Deployment's pods", p.Name)
			continue
		}
		d := m.deployments[i]
		pods := minReplicas(m, d)
		var allowed int
		switch {
		case p.Spec.MaxUnavailable != nil:
			allowed, err = intstrValue(p.Spec.MaxUnavailable, pods, true)
		case p.Spec.MinAvailable != nil:
			var least int
			least, err = intstrValue(p.Spec.MinAvailable, pods, false)
			allowed = pods - least
		default:
			err = errNoBudget
		}
		if err != nil {
			t.Errorf("PodDisruptionBudget %s: %v", p.Name, err)
			continue
		}
		if allowed <= 0 {
			t.Errorf("PodDisruptionBudget %s: at %d pods of %s it allows no eviction, so a node drain never ends", p.Name, pods, d.Name)
		}
		if allowed >= pods && !strings.Contains(m.comments["PodDisruptionBudget/"+p.Name], "protects nothing") {
			t.Errorf("PodDisruptionBudget %s: at %d pods of %s it lets every pod go: size the pool, or say in its comment that it protects nothing", p.Name, pods, d.Name)
		}
	}
}

var errNoBudget = errors.New("neither minAvailable nor maxUnavailable")

// intstrValue is v for a pool of pods: a count, or a percentage rounded
// up (maxUnavailable, as the disruption controller does) or down.
func intstrValue(v *intstr.IntOrString, pods int, roundUp bool) (int, error) {
	return intstr.GetScaledValueFromIntOrPercent(v, pods, roundUp)
}

// TestKubernetesScraping checks that every pod that runs pdq is scraped:
// a PodMonitor selects it on the named port where pdq serves /metrics
// (the gateway's PDQ_HTTP_ADDR, a worker's PDQ_METRICS_ADDR), and the pod
// carries the prometheus.io annotations for that port.
func TestKubernetesScraping(t *testing.T) {
	m := readManifests(t)
	if len(m.monitors) == 0 {
		t.Fatal("no PodMonitor in deploy/k8s")
	}
	for _, d := range m.deployments {
		tmpl := d.Spec.Template
		for _, c := range tmpl.Spec.Containers {
			if !isPdq(c) {
				continue
			}
			where := d.Name + "/" + c.Name
			variable := "PDQ_METRICS_ADDR"
			if c.Args[0] == "gateway" {
				variable = "PDQ_HTTP_ADDR"
			}
			addr, _ := env(c, variable)
			_, port, err := net.SplitHostPort(addr)
			if err != nil {
				t.Errorf("%s: %s %q: %v", where, variable, addr, err)
				continue
			}
			i := slices.IndexFunc(c.Ports, func(p corev1.ContainerPort) bool { return strconv.Itoa(int(p.ContainerPort)) == port })
			if i < 0 || c.Ports[i].Name == "" {
				t.Errorf("%s: no named container port %s, where pdq serves /metrics (%s)", where, port, variable)
				continue
			}
			name := c.Ports[i].Name
			if !slices.ContainsFunc(m.monitors, func(pm podMonitor) bool {
				sel, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
				return err == nil && !sel.Empty() && sel.Matches(labels.Set(tmpl.Labels)) &&
					slices.ContainsFunc(pm.Spec.PodMetricsEndpoints, func(e podMetricsEndpoint) bool {
						return e.Port == name && (e.Path == "" || e.Path == "/metrics")
					})
			}) {
				t.Errorf("%s: no PodMonitor scrapes port %s of its pods", where, name)
			}
			a := tmpl.Annotations
			if a["prometheus.io/scrape"] != "true" || a["prometheus.io/port"] != port || a["prometheus.io/path"] != "/metrics" {
				t.Errorf("%s: annotations %v; want prometheus.io/scrape \"true\", port %q, path /metrics", where, a, port)
			}
		}
	}
}

// TestKubernetesKEDA checks the ScaledObjects against what KEDA's
// nats-jetstream scaler does (pkg/scalers/nats_jetstream_scaler.go):
//   - it reads the consumer it is given, and a name that does not exist
//     reports the stream's last sequence as the lag, which scales the
//     target to its maximum: every consumer name, and every pool name in
//     keda.yaml and docs/deploy.md, is the one pdq computes for the served
//     model, and keda.yaml says how to print them (pdq pool-name);
//   - its lag is num_pending + num_ack_pending, so it counts the running
//     jobs: each lagThreshold is its pool's slots a pod (PDQ_ENGINE_SLOTS),
//     so that a busy pod asks for one pod, not slots/threshold of them;
//   - with the chart's cluster (no_advertise), it reaches each server at
//     <server name>.<endpoint host>: the endpoint is the chart's headless
//     Service, under which the pods resolve;
//   - cooldownPeriod only delays a scale to zero, so with minReplicaCount
//     1 or more it does nothing: scale-in is set on the HPA instead.
func TestKubernetesKEDA(t *testing.T) {
	m := readManifests(t)
	model := servedModelOf(t, m)
	pool := dispatcher.PoolName(model)
	streams := map[string]dispatcher.Stage{dispatcher.StreamPrefill: dispatcher.StagePrefill, dispatcher.StreamDecode: dispatcher.StageDecode}

	// The slots a pod of each stage's workers has.
	slots := map[dispatcher.Stage]string{}
	for _, d := range m.deployments {
		for _, c := range d.Spec.Template.Spec.Containers {
			if !isPdq(c) || len(c.Args) == 0 {
				continue
			}
			if stage := dispatcher.Stage(c.Args[0]); stage == dispatcher.StagePrefill || stage == dispatcher.StageDecode {
				v, ok := env(c, "PDQ_ENGINE_SLOTS")
				if !ok {
					t.Errorf("%s/%s: PDQ_ENGINE_SLOTS is not set; keda.yaml's lagThreshold is derived from it", d.Name, c.Name)
				}
				slots[stage] = v
			}
		}
	}

	// The NATS chart's names, for the release and namespace it is
	// installed as (the install line in nats-values.yaml and in
	// docs/deploy.md): the chart's fullname is the release's name when that
	// contains the chart's ("nats"), the headless Service is
	// <fullname>-headless, and the pods (<fullname>-N) resolve under it.
	values := readNATSValues(t)
	install := regexp.MustCompile(`helm install (\S+) nats/nats -n (\S+) -f deploy/k8s/nats-values\.yaml`).FindStringSubmatch(values.raw)
	if install == nil {
		t.Fatal("nats-values.yaml does not say how it is installed (helm install RELEASE nats/nats -n NAMESPACE -f deploy/k8s/nats-values.yaml)")
	}
	deployDoc, err := os.ReadFile(repoRoot + "/docs/deploy.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(deployDoc), install[0]) {
		t.Errorf("docs/deploy.md does not install the chart as nats-values.yaml says: %s", install[0])
	}
	release, namespace := install[1], install[2]
	fullname := release
	if !strings.Contains(release, "nats") {
		fullname = release + "-nats"
	}
	monitorPort := values.Config.Monitor.Port
	if monitorPort == 0 {
		monitorPort = 8222 // the chart's default
	}
	endpoint := fmt.Sprintf("%s-headless.%s.svc.cluster.local:%d", fullname, namespace, monitorPort)
	for _, d := range m.deployments {
		for _, c := range d.Spec.Template.Spec.Containers {
			if u, ok := env(c, "PDQ_NATS_URL"); ok && isPdq(c) {
				for _, one := range strings.Split(u, ",") {
					if parsed, err := url.Parse(one); err != nil || (parsed.Hostname() != fullname && !strings.HasPrefix(parsed.Hostname(), fullname+"."+namespace+".")) {
						t.Errorf("%s/%s: PDQ_NATS_URL %s is not the chart's Service %s", d.Name, c.Name, one, fullname)
					}
				}
			}
		}
	}

	keda, err := os.ReadFile(repoRoot + "/deploy/k8s/keda.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(m.scaled) == 0 {
		t.Fatal("no ScaledObject")
	}
	for _, so := range m.scaled {
		name := "ScaledObject " + so.Metadata.Name
		i := slices.IndexFunc(m.deployments, func(d appsv1.Deployment) bool { return d.Name == so.Spec.ScaleTargetRef.Name })
		if i < 0 {
			t.Errorf("%s scales %s, which is no Deployment of deploy/k8s", name, so.Spec.ScaleTargetRef.Name)
			continue
		}
		target := m.deployments[i]
		least := so.Spec.MinReplicaCount
		if least == nil || *least < 1 {
			t.Errorf("%s: minReplicaCount %v; want 1 or more (with no live worker the gateway answers 404, and an engine takes minutes to start)", name, least)
		} else {
			if so.Spec.CooldownPeriod != nil {
				t.Errorf("%s: cooldownPeriod %d does nothing with minReplicaCount %d (it only delays a scale to zero); set the HPA's scaleDown instead", name, *so.Spec.CooldownPeriod, *least)
			}
			if target.Spec.Replicas == nil || *target.Spec.Replicas != *least {
				t.Errorf("%s: minReplicaCount %d, but Deployment %s has replicas %v", name, *least, target.Name, target.Spec.Replicas)
			}
		}
		if a := so.Spec.Advanced; a == nil || a.HorizontalPodAutoscalerConfig.Behavior == nil || a.HorizontalPodAutoscalerConfig.Behavior.ScaleDown == nil ||
			a.HorizontalPodAutoscalerConfig.Behavior.ScaleDown.StabilizationWindowSeconds == nil {
			t.Errorf("%s: no scale-down stabilization window (advanced.horizontalPodAutoscalerConfig.behavior.scaleDown)", name)
		}
		for _, tr := range so.Spec.Triggers {
			if tr.Type != "nats-jetstream" {
				t.Errorf("%s: trigger %s; want nats-jetstream", name, tr.Type)
				continue
			}
			stage, ok := streams[tr.Metadata["stream"]]
			if !ok {
				t.Errorf("%s: stream %q is not one of pdq's work streams", name, tr.Metadata["stream"])
				continue
			}
			if want := dispatcher.ConsumerName(stage, pool); tr.Metadata["consumer"] != want {
				t.Errorf("%s: consumer %q; the %s workers of %q consume %q (pdq pool-name --consumer %s %s)", name, tr.Metadata["consumer"], stage, model, want, stage, model)
			}
			if want := slots[stage]; want == "" || tr.Metadata["lagThreshold"] != want {
				t.Errorf("%s: lagThreshold %q; the lag counts running jobs, so want the %s workers' slots a pod, PDQ_ENGINE_SLOTS=%q", name, tr.Metadata["lagThreshold"], stage, want)
			}
			if got := tr.Metadata["natsServerMonitoringEndpoint"]; got != endpoint {
				t.Errorf("%s: natsServerMonitoringEndpoint %q; want the chart's headless Service, %q, under which KEDA finds each server (%s-0.%s)", name, got, endpoint, fullname, endpoint)
			}
			if tr.Metadata["account"] != "$G" {
				t.Errorf("%s: account %q; pdq's NATS has no accounts: $G", name, tr.Metadata["account"])
			}
		}
	}

	// Every pool or consumer name written out is the computed one, and
	// keda.yaml says how to print each consumer's.
	hashed := regexp.MustCompile(`[A-Za-z0-9_-]*_[A-Za-z0-9_-]*-[0-9a-f]{8}\b`)
	for file, text := range map[string]string{"deploy/k8s/keda.yaml": string(keda), "docs/deploy.md": string(deployDoc)} {
		for _, got := range hashed.FindAllString(text, -1) {
			if got != pool && got != dispatcher.ConsumerName(dispatcher.StagePrefill, pool) && got != dispatcher.ConsumerName(dispatcher.StageDecode, pool) {
				t.Errorf("%s names %q; the pool of %q is %q (pdq pool-name %s)", file, got, model, pool, model)
			}
		}
	}
	for _, stage := range []dispatcher.Stage{dispatcher.StagePrefill, dispatcher.StageDecode} {
		if line := fmt.Sprintf("pdq pool-name --consumer %s %s", stage, model); !strings.Contains(string(keda), line) {
			t.Errorf("deploy/k8s/keda.yaml does not say how its %s consumer's name is made: %q", stage, line)
		}
	}
}

package tests

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDeployVersions keeps the versions of what the deploy files run in
// one place each:
//   - NATS: go.mod's nats-server is the server pdq embeds and is tested
//     on; every NATS image (docker-compose.yml, the Helm values) and every
//     `go run github.com/nats-io/nats-server/v2@...` in the docs and
//     configurations has its major and minor version.
//   - vLLM: every vLLM image names a version (no :latest, no missing tag),
//     and it is the same one in docker-compose.yml and deploy/k8s: prefill
//     and decode must run the same build, as the NIXL handshake compares
//     versions.
func TestDeployVersions(t *testing.T) {
	mod, err := os.ReadFile(repoRoot + "/go.mod")
	if err != nil {
		t.Fatal(err)
	}
	sm := regexp.MustCompile(`(?m)^\s*github\.com/nats-io/nats-server/v2 v(\d+)\.(\d+)\.\d+`).FindStringSubmatch(string(mod))
	if sm == nil {
		t.Fatal("go.mod requires no github.com/nats-io/nats-server/v2")
	}
	minor := sm[1] + "." + sm[2]
	sameMinor := func(where, version string) {
		t.Helper()
		if v := strings.TrimPrefix(version, "v"); v != minor && !strings.HasPrefix(v, minor+".") && !strings.HasPrefix(v, minor+"-") {
			t.Errorf("%s: NATS %s; go.mod's nats-server is %s.x", where, version, minor)
		}
	}

	var natsImages, vllmImages []string // "where: image"
	f := readCompose(t)
	services := map[string]composeService{"x-pdq": f.Base, "x-vllm": f.VLLM}
	for name, s := range f.Services {
		services[name] = s
	}
	for name, s := range services {
		image := composeDefault(s.Image)
		switch {
		case strings.HasPrefix(image, "nats:") || image == "nats":
			natsImages = append(natsImages, "docker-compose.yml "+name+": "+image)
		case strings.HasPrefix(image, "vllm/"):
			vllmImages = append(vllmImages, "docker-compose.yml "+name+": "+image)
		}
	}
	m := readManifests(t)
	for _, d := range m.deployments {
		for _, c := range d.Spec.Template.Spec.Containers {
			switch {
			case strings.HasPrefix(c.Image, "nats:"):
				natsImages = append(natsImages, "deploy/k8s "+d.Name+": "+c.Image)
			case isVLLM(c):
				vllmImages = append(vllmImages, "deploy/k8s "+d.Name+": "+c.Image)
			}
		}
	}
	// The chart's own default tag is older than pdq's server: the values
	// must set one.
	natsImages = append(natsImages, "deploy/k8s/nats-values.yaml container.image.tag: nats:"+readNATSValues(t).Container.Image.Tag)

	if len(natsImages) < 2 {
		t.Errorf("NATS images %v; want docker-compose.yml's and the Helm values'", natsImages)
	}
	for _, one := range natsImages {
		where, image, _ := strings.Cut(one, ": ")
		_, tag, _ := strings.Cut(image, ":")
		sameMinor(where, tag)
	}

	if len(vllmImages) < 3 {
		t.Errorf("vLLM images %v; want docker-compose.yml's and the two Deployments'", vllmImages)
	}
	var pinned string
	for _, one := range vllmImages {
		where, image, _ := strings.Cut(one, ": ")
		_, tag, _ := strings.Cut(image, ":")
		if tag == "" || tag == "latest" || strings.HasPrefix(tag, "latest-") {
			t.Errorf("%s: %s; pin a vLLM version", where, image)
		}
		if pinned == "" {
			pinned = image
		} else if image != pinned {
			t.Errorf("%s: %s; another runs %s: prefill and decode must run the same vLLM build", where, image, pinned)
		}
	}

	// `go run .../nats-server/v2@vX.Y.Z` in the docs and configurations.
	goRun := regexp.MustCompile(`github\.com/nats-io/nats-server/v2@(v[0-9][^\s` + "`" + `]*)`)
	var files []string
	for _, glob := range []string{"/README.md", "/docs/*.md", "/deploy/README.md", "/nats/*.conf", "/nats/cluster/*.conf"} {
		matches, err := filepath.Glob(repoRoot + glob)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, matches...)
	}
	for _, file := range files {
		raw, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, sm := range goRun.FindAllStringSubmatch(string(raw), -1) {
			sameMinor(strings.TrimPrefix(file, repoRoot+"/"), sm[1])
		}
	}
}

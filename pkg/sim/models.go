package sim

import (
	"encoding/json"
	"hash/fnv"
	"io"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/pkg/openai"
	"github.com/pdq-dev/pdq/pkg/sim/simconfig"
	"github.com/pdq-dev/pdq/pkg/sim/tokenizer"
)

// modelNames holds the names an engine answers to: the base model's served
// names and the LoRA adapters, as vLLM's OpenAIServingModels does.
type modelNames struct {
	served []string // the base model's names; responses carry the first
	root   string   // --model

	mu    sync.RWMutex
	loras []lora // in load order, as /v1/models lists them
}

// lora is a loaded adapter.
type lora struct {
	name, path string
	// base is the served name given as its base_model_name, if that is a
	// served name; vLLM ignores any other.
	base string
}

// target is what a request's model resolves to.
type target struct {
	// name is the model responses carry: the first served name for the
	// base model (vLLM's OpenAIServingModels.model_name), else the adapter.
	name string
	// adapter is the LoRA adapter, "" for the base model.
	adapter string
}

func newModelNames(cfg simconfig.Config) *modelNames {
	g := &modelNames{served: cfg.ServedNames(), root: cfg.Model}
	for _, m := range cfg.LoRAModules {
		g.load(m.Name, m.Path, m.BaseModelName, false)
	}
	return g
}

func (g *modelNames) isBase(name string) bool { return slices.Contains(g.served, name) }

// resolve finds the model a request names; "" is the base model. An
// adapter wins over a served name of the same name, as in vLLM.
func (g *modelNames) resolve(name string) (target, bool) {
	g.mu.RLock()
	defer g.mu.RUnlock()
	for _, l := range g.loras {
		if l.name == name {
			return target{name: l.name, adapter: l.name}, true
		}
	}
	if name == "" || g.isBase(name) {
		return target{name: g.served[0]}, true
	}
	return target{}, false
}

// load adds or, in place, replaces an adapter. It reports false if the
// name is taken and inPlace is not set.
func (g *modelNames) load(name, path, base string, inPlace bool) bool {
	if !g.isBase(base) {
		base = ""
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for i, l := range g.loras {
		if l.name == name {
			if !inPlace {
				return false
			}
			g.loras[i] = lora{name: name, path: path, base: base}
			return true
		}
	}
	g.loras = append(g.loras, lora{name: name, path: path, base: base})
	return true
}

func (g *modelNames) unload(name string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for i, l := range g.loras {
		if l.name == name {
			g.loras = slices.Delete(g.loras, i, i+1)
			return true
		}
	}
	return false
}

// unknownModel is vLLM's answer to a model it does not serve.
func unknownModel(name string) *openai.Error {
	return openai.NewError(http.StatusNotFound, "The model `%s` does not exist.", name).WithParam("model")
}

// modelFor is the text generator of a target: the engine's seed for the
// base model, a seed mixed with the adapter's name for an adapter, so that
// an adapter says something else than the base model.
func (e *Engine) modelFor(t target) tokenizer.Model {
	if t.adapter == "" {
		return tokenizer.Model{Seed: e.cfg.Seed}
	}
	h := fnv.New64a()
	h.Write([]byte(t.adapter))
	return tokenizer.Model{Seed: tokenizer.Mix(e.cfg.Seed ^ h.Sum64())}
}

// modelCard is one entry of GET /v1/models, in vLLM's shape (ModelCard):
// root, parent and max_model_len are always present, null when unset.
type modelCard struct {
	ID          string            `json:"id"`
	Object      string            `json:"object"`
	Created     int64             `json:"created"`
	OwnedBy     string            `json:"owned_by"`
	Root        *string           `json:"root"`
	Parent      *string           `json:"parent"`
	MaxModelLen *int              `json:"max_model_len"`
	Permission  []modelPermission `json:"permission"`
}

// modelPermission is vLLM's ModelPermission with its defaults.
type modelPermission struct {
	ID                 string  `json:"id"`
	Object             string  `json:"object"`
	Created            int64   `json:"created"`
	AllowCreateEngine  bool    `json:"allow_create_engine"`
	AllowSampling      bool    `json:"allow_sampling"`
	AllowLogprobs      bool    `json:"allow_logprobs"`
	AllowSearchIndices bool    `json:"allow_search_indices"`
	AllowView          bool    `json:"allow_view"`
	AllowFineTuning    bool    `json:"allow_fine_tuning"`
	Organization       string  `json:"organization"`
	Group              *string `json:"group"`
	IsBlocking         bool    `json:"is_blocking"`
}

func newPermission(now int64) modelPermission {
	return modelPermission{ID: "modelperm-" + randomHex(16), Object: "model_permission", Created: now,
		AllowSampling: true, AllowLogprobs: true, AllowView: true, Organization: "*"}
}

// models lists the served names, then the adapters, as vLLM's
// show_available_models: a served name's root is --model and its parent
// null; an adapter's root is its path, its parent its base model (the
// first served name unless it was loaded with another base_model_name),
// and its max_model_len null. Like vLLM, created is the time of the call.
func (e *Engine) models(w http.ResponseWriter, _ *http.Request) {
	now := time.Now().Unix()
	g := e.names
	var data []modelCard
	for _, name := range g.served {
		maxLen, root := e.cfg.MaxModelLen, g.root
		data = append(data, modelCard{ID: name, Object: openai.ObjectModel, Created: now, OwnedBy: "vllm",
			Root: &root, MaxModelLen: &maxLen, Permission: []modelPermission{newPermission(now)}})
	}
	g.mu.RLock()
	for _, l := range g.loras {
		path, parent := l.path, l.base
		if parent == "" {
			parent = g.served[0]
		}
		data = append(data, modelCard{ID: l.name, Object: openai.ObjectModel, Created: now, OwnedBy: "vllm",
			Root: &path, Parent: &parent, Permission: []modelPermission{newPermission(now)}})
	}
	g.mu.RUnlock()
	writeJSON(w, http.StatusOK, struct {
		Object string      `json:"object"`
		Data   []modelCard `json:"data"`
	}{openai.ObjectList, data})
}

// loraError is vLLM's error of the LoRA routes, whose types are not the
// usual ones ("InvalidUserInput").
func loraError(status int, typ, msg string) *openai.Error {
	return &openai.Error{Message: msg, Type: typ, Code: status}
}

// writeText answers 200 with a bare string, as vLLM's LoRA routes do
// (a Starlette Response with no media type: no Content-Type).
func writeText(w http.ResponseWriter, s string) {
	w.Header()["Content-Type"] = nil
	w.WriteHeader(http.StatusOK)
	io.WriteString(w, s)
}

// readLoRABody reads the body of a LoRA route.
func readLoRABody(w http.ResponseWriter, r *http.Request, v any) *openai.Error {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
	if err != nil {
		return openai.NewError(http.StatusBadRequest, "invalid request body: %v", err)
	}
	if err := json.Unmarshal(body, v); err != nil {
		return openai.NewError(http.StatusBadRequest, "invalid request body: %v", err)
	}
	return nil
}

// loadLoRA serves POST /v1/load_lora_adapter {"lora_name","lora_path",
// "load_inplace"}, with vLLM's messages.
func (e *Engine) loadLoRA(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Name          string `json:"lora_name"`
		Path          string `json:"lora_path"`
		LoadInplace   bool   `json:"load_inplace"`
		BaseModelName string `json:"base_model_name"`
	}
	if apiErr := readLoRABody(w, r, &in); apiErr != nil {
		openai.WriteError(w, apiErr)
		return
	}
	if in.Name == "" || in.Path == "" {
		openai.WriteError(w, loraError(http.StatusBadRequest, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."))
		return
	}
	if !e.names.load(in.Name, in.Path, in.BaseModelName, in.LoadInplace) {
		openai.WriteError(w, loraError(http.StatusBadRequest, "InvalidUserInput",
			"The lora adapter '"+in.Name+"' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."))
		return
	}
	e.log.Info("Loaded new LoRA adapter", "lora_name", in.Name, "lora_path", in.Path)
	writeText(w, "Success: LoRA adapter '"+in.Name+"' added successfully.")
}

// unloadLoRA serves POST /v1/unload_lora_adapter {"lora_name"}.
func (e *Engine) unloadLoRA(w http.ResponseWriter, r *http.Request) {
	var in struct {
		Name string `json:"lora_name"`
	}
	if apiErr := readLoRABody(w, r, &in); apiErr != nil {
		openai.WriteError(w, apiErr)
		return
	}
	if in.Name == "" {
		openai.WriteError(w, loraError(http.StatusBadRequest, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter."))
		return
	}
	if !e.names.unload(in.Name) {
		openai.WriteError(w, loraError(http.StatusNotFound, "NotFoundError", "The lora adapter '"+in.Name+"' cannot be found."))
		return
	}
	e.log.Info("Removed LoRA adapter", "lora_name", in.Name)
	writeText(w, "Success: LoRA adapter '"+in.Name+"' removed successfully.")
}

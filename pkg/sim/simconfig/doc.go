// Package simconfig is what a simulated engine is: its settings, as vLLM's
// own flags name them where vLLM has one (the model, its served names and
// LoRA adapters, max_model_len, the KV lease), and the timings and faults
// only pdq sim has, with the injector that draws each request's fault
// (FaultInjector). pdq sim parses them from its flags (RegisterFlags), and
// tests build them directly (DefaultConfig).
package simconfig

// Package tokenizer is the simulated engine's tokenizer and text: the
// token ids of a text and the text of ids, a chat rendered by the engine's
// template, and the model that picks each next token (and a prompt's
// embedding) as a pure function of the prompt, so that tests can predict
// what an engine answers. It is no model's tokenizer; it only has to be
// simple and stable.
package tokenizer

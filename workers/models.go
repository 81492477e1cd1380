package workers

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/stage"
	"github.com/pdq-dev/pdq/pkg/logging"
	"github.com/pdq-dev/pdq/pkg/vllm"
)

// modelLoop is the stage loop of one model the engine serves.
type modelLoop struct {
	model vllm.Model
	stop  context.CancelFunc
}

// serveModels runs a stage loop for each model the engine serves, one pool
// per model, until ctx ends: the engine's base model under each of its
// served names, and each LoRA adapter. The loops share the engine's slots.
// Every ModelsRefresh it asks the engine again: a model that appears gets
// a loop, one that is gone (or whose context length changed) has its loop
// stopped (its running jobs finish within the grace period), and started
// again if still served. A loop that fails at start-up stops the worker; one
// that fails later (NATS refusing its consumer, say) is logged and started
// again at the next refresh.
func (w *Worker) serveModels(ctx context.Context, models []vllm.Model) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	loops := make(map[string]*modelLoop)
	failed := make(chan *modelLoop, 1)
	var wg sync.WaitGroup
	next := 0 // numbers the registry entries of the worker's loops
	started := false
	reconcile := func(models []vllm.Model) error {
		want := make(map[string]vllm.Model, len(models))
		for _, m := range models {
			want[m.ID] = m
		}
		for id, l := range loops {
			m, ok := want[id]
			switch {
			case !ok:
				w.log.Info("engine no longer serves the model: leaving its pool", "model", id)
			case m.MaxModelLen != l.model.MaxModelLen:
				w.log.Info("engine's context length for the model changed", "model", id,
					"max_model_len", m.MaxModelLen, "was", l.model.MaxModelLen)
			default:
				continue
			}
			l.stop()
			delete(loops, id)
		}
		for _, m := range models {
			if _, ok := loops[m.ID]; ok {
				continue
			}
			next++
			loop, err := stage.NewLoop(w.nc, w.js, w.loopConfig(m, w.id+"-"+strconv.Itoa(next)), w.log.With("model", m.ID))
			if err != nil {
				return err
			}
			lctx, stop := context.WithCancel(ctx)
			l := &modelLoop{model: m, stop: stop}
			loops[m.ID] = l
			atStart := !started
			wg.Go(func() {
				err := loop.Run(lctx)
				switch {
				case err == nil || lctx.Err() != nil:
				case atStart:
					cancel(fmt.Errorf("model %s: %w", m.ID, err))
				default:
					w.log.Warn("the model's stage loop failed; it starts again at the next refresh", "model", m.ID, logging.Err(err))
					select {
					case failed <- l:
					case <-ctx.Done():
					}
				}
			})
			w.log.Info("engine serves model", "model", m.ID, "pool", dispatcher.PoolName(m.ID), "slots", w.cfg.Slots,
				"max_model_len", m.MaxModelLen)
		}
		started = true
		w.mu.Lock()
		w.served = models
		w.mu.Unlock()
		return nil
	}
	err := reconcile(models)
	t := time.NewTicker(w.cfg.ModelsRefresh)
	defer t.Stop()
	for err == nil && ctx.Err() == nil {
		select {
		case <-ctx.Done():
		case l := <-failed:
			if loops[l.model.ID] == l {
				delete(loops, l.model.ID)
			}
		case <-t.C:
			qctx, qcancel := context.WithTimeout(ctx, 5*time.Second)
			models, qerr := w.engine.Models(qctx)
			qcancel()
			if qerr != nil {
				// A sick engine is the breaker's business: its models stay.
				w.log.Debug("could not re-read the engine's models", logging.Err(qerr))
				continue
			}
			err = reconcile(models)
		}
	}
	cancel(err)
	wg.Wait()
	if err == nil {
		// A loop's failure, or nil when the worker was stopped.
		if err = context.Cause(ctx); errors.Is(err, context.Canceled) {
			err = nil
		}
	}
	return err
}

// probeModel is the model the breaker's deep probe asks for one token: the
// engine's first.
func (w *Worker) probeModel() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.served) == 0 {
		return ""
	}
	return w.served[0].ID
}

package stage

import (
	"context"

	"github.com/pdq-dev/pdq/dispatcher"
	"github.com/pdq-dev/pdq/dispatcher/registry"
)

// heartbeat keeps the loop's worker heard in the registries until ctx
// ends (registry.Heartbeat); a loop without a worker id is not heard.
func (l *Loop) heartbeat(ctx context.Context) {
	if l.cfg.Worker.ID == "" {
		return
	}
	registry.Heartbeat(ctx, l.nc, l.js, l.cfg.Replicas, l.cfg.Worker, l.beatInfo, l.cfg.Stage == dispatcher.StageDecode, l.log)
}

// beatInfo sets what a heartbeat reports of the loop now: its load, the
// engine's seats (what it runs at once, see [pull.EngineSlots.SetLimit]:
// the decode gate counts on it) and the breaker, whose changes it returns.
func (l *Loop) beatInfo(info *dispatcher.WorkerInfo) (healthChanged <-chan struct{}) {
	info.InFlight = l.InFlight()
	info.Seats = 0
	if e := l.cfg.EngineSlots; e != nil {
		info.Seats = min(l.cfg.Slots, e.Seats())
	}
	info.KVReleased, info.DeadLettersRefused = l.Released(), l.dlqRefused.Load()
	info.AvgJobMs = l.avgJobMs()
	if l.cfg.Health != nil {
		info.Breaker, healthChanged = l.cfg.Health()
	}
	return healthChanged
}

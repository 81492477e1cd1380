// Package registry says who is there. Workers send heartbeats
// ([Heartbeat]) that every gateway and decode gate keeps, on its own clock,
// as a view of the live workers ([Registry]): their pools, slots, seats,
// breakers and engines' model cards. Workers ask, before they spend an
// engine on a job, whether the gateway holding its client still answers
// ([Liveness], [AnswerPings]). It lives apart from the stage loop so
// that the gateway can watch workers without importing their runtime.
package registry

package gateway

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"net/http"
	"strings"

	"github.com/labstack/echo/v4"
	"github.com/pdq-dev/pdq/pkg/openai"
)

// requireKey checks the bearer token when API keys are configured.
func (h *handlers) requireKey(next echo.HandlerFunc) echo.HandlerFunc {
	if len(h.cfg.APIKeys) == 0 && len(h.cfg.OperatorKeys) == 0 {
		return next
	}
	return func(c echo.Context) error {
		got, ok := strings.CutPrefix(c.Request().Header.Get("Authorization"), "Bearer ")
		match := func(keys []string) bool {
			found := 0
			for _, k := range keys {
				found |= subtle.ConstantTimeCompare([]byte(got), []byte(k))
			}
			return ok && found == 1
		}
		switch {
		case match(h.cfg.OperatorKeys):
			c.Set(callerKey, caller{owner: keyOwner(got), operator: true})
		case match(h.cfg.APIKeys):
			c.Set(callerKey, caller{owner: keyOwner(got)})
		default:
			return writeError(c, openai.NewError(http.StatusUnauthorized, "invalid or missing API key"))
		}
		return next(c)
	}
}

// caller is who sent a request, by its API key.
type caller struct {
	// owner names the key (keyOwner); empty on a gateway without keys.
	owner string
	// operator keys read every request's record.
	operator bool
}

const callerKey = "pdq.caller"

// callerOf is the request's caller: with no keys configured, an anonymous
// operator.
func callerOf(c echo.Context) caller {
	if who, ok := c.Get(callerKey).(caller); ok {
		return who
	}
	return caller{operator: true}
}

// keyOwner names an API key in records without storing it: the first 16
// hex digits of its SHA-256.
func keyOwner(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:8])
}

package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/pdq-dev/pdq/pkg/config"
)

// Connection settings every pdq process shares.
const (
	// natsReconnectWait is the pause between attempts on one server. The
	// default 2 s would add up to 2 s to every recovery from a NATS
	// restart; another server of a cluster is tried at once anyway.
	natsReconnectWait = 250 * time.Millisecond
	// natsPingInterval and natsMaxPingsOut notice a server that went away
	// without closing the connection (power, network) within 15 s,
	// instead of the client's default 4 minutes.
	natsPingInterval = 5 * time.Second
	natsMaxPingsOut  = 3
)

// natsAuth turns the PDQ_NATS_* credentials into connection options. The
// files are read here, so that a wrong path or a file of the wrong kind is
// named at start-up rather than reported as a failed connection.
func natsAuth(c config.NATS) ([]nats.Option, error) {
	var opts []nats.Option
	switch {
	case c.User != "":
		opts = append(opts, nats.UserInfo(c.User, c.Password))
	case c.Token != "":
		opts = append(opts, nats.Token(c.Token))
	case c.Creds != "":
		if err := checkCreds(c.Creds); err != nil {
			return nil, fmt.Errorf("%w: PDQ_NATS_CREDS: %w", config.ErrInvalid, err)
		}
		opts = append(opts, nats.UserCredentials(c.Creds))
	}
	if c.CA != "" {
		pem, err := os.ReadFile(c.CA)
		if err != nil {
			return nil, fmt.Errorf("%w: PDQ_NATS_CA: %w", config.ErrInvalid, err)
		}
		if !x509.NewCertPool().AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%w: PDQ_NATS_CA: %s holds no PEM certificate", config.ErrInvalid, c.CA)
		}
		opts = append(opts, nats.RootCAs(c.CA))
	}
	if c.Cert != "" {
		if _, err := tls.LoadX509KeyPair(c.Cert, c.Key); err != nil {
			return nil, fmt.Errorf("%w: PDQ_NATS_CERT and PDQ_NATS_KEY: %w", config.ErrInvalid, err)
		}
		opts = append(opts, nats.ClientCert(c.Cert, c.Key))
	}
	return opts, nil
}

// checkCreds checks that path is a NATS credentials file: a user JWT and
// its nkey seed.
func checkCreds(path string) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	// Both parsers take undecorated text as the thing itself: the seed
	// check fails on such text, the JWT's shape is checked by hand.
	if _, err := nkeys.ParseDecoratedUserNKey(raw); err != nil {
		return fmt.Errorf("%s holds no user nkey seed: %w", path, err)
	}
	if jwt, err := nkeys.ParseDecoratedJWT(raw); err != nil || strings.Count(jwt, ".") != 2 {
		return fmt.Errorf("%s holds no user JWT", path)
	}
	return nil
}

// connectError says what to check when the server refused the connection:
// trying again would not help.
func connectError(err error) (permanent bool, hint string) {
	var (
		unknownCA *x509.UnknownAuthorityError
		hostname  x509.HostnameError
		invalid   x509.CertificateInvalidError
		verify    *tls.CertificateVerificationError
		alert     tls.AlertError
	)
	switch {
	case errors.Is(err, nats.ErrAuthorization), errors.Is(err, nats.ErrAuthExpired), errors.Is(err, nats.ErrAuthRevoked),
		errors.Is(err, nats.ErrAccountAuthExpired):
		return true, "the server refused the credentials: check PDQ_NATS_USER and PDQ_NATS_PASSWORD, PDQ_NATS_TOKEN or PDQ_NATS_CREDS"
	case errors.As(err, &unknownCA), errors.As(err, &hostname), errors.As(err, &invalid), errors.As(err, &verify):
		return true, "the server's certificate is not trusted: check PDQ_NATS_CA and the host name in PDQ_NATS_URL"
	case errors.As(err, &alert), errors.Is(err, nats.ErrSecureConnRequired), errors.Is(err, nats.ErrSecureConnWanted),
		errors.Is(err, nats.ErrClientCertOrRootCAsRequired):
		return true, "TLS is set up differently on the server: check PDQ_NATS_CA, PDQ_NATS_CERT and PDQ_NATS_KEY"
	}
	return false, ""
}

// redactURLs is a list of NATS URLs, comma-separated, fit for a log line
// or an error: a password, or a token (a user without one), is replaced
// by xxxxx. A URL without a scheme is shown with nats://, as nats.go reads
// it; one that does not parse loses all before its last @. nats.go's
// ConnectedUrlRedacted leaves a token as it is.
func redactURLs(list string) string {
	urls := strings.Split(list, ",")
	for i, raw := range urls {
		raw = strings.TrimSpace(raw)
		if !strings.Contains(raw, "://") {
			raw = "nats://" + raw // as nats.go reads a URL without a scheme
		}
		u, err := url.Parse(raw)
		switch {
		case err != nil:
			if at := strings.LastIndex(raw, "@"); at >= 0 {
				raw = "xxxxx" + raw[at:]
			}
			urls[i] = raw
		case u.User == nil:
			urls[i] = raw
		default:
			if _, hasPassword := u.User.Password(); hasPassword {
				u.User = url.UserPassword(u.User.Username(), "xxxxx")
			} else {
				u.User = url.User("xxxxx") // a token
			}
			urls[i] = u.String()
		}
	}
	return strings.Join(urls, ",")
}

package tests

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/pdq-dev/pdq/dispatcher"
)

// startAuthServer runs a NATS server with JetStream in the test process,
// listening on loopback, with auth set up by configure.
func startAuthServer(t *testing.T, configure func(*server.Options)) string {
	t.Helper()
	opts := &server.Options{
		ServerName: "pdq-auth", Host: "127.0.0.1", Port: server.RANDOM_PORT,
		JetStream: true, StoreDir: t.TempDir(), MaxPayload: 8 << 20,
		NoSigs: true, NoLog: true,
	}
	configure(opts)
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("NATS server with credentials not ready within 10s")
	}
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	return srv.ClientURL()
}

// testPKI is a CA, a server certificate for 127.0.0.1 and a client
// certificate, as PEM files.
type testPKI struct {
	ca, serverCert, serverKey, clientCert, clientKey string
}

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	dir := t.TempDir()
	write := func(name, kind string, der []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	key := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	now := time.Now()
	caKey := key()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "pdq test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	leaf := func(serial int64, name string, usage x509.ExtKeyUsage) (certPath, keyPath string) {
		k := key()
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{usage}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &k.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		kder, err := x509.MarshalECPrivateKey(k)
		if err != nil {
			t.Fatal(err)
		}
		return write(name+".pem", "CERTIFICATE", der), write(name+"-key.pem", "EC PRIVATE KEY", kder)
	}
	p := testPKI{ca: write("ca.pem", "CERTIFICATE", caDER)}
	p.serverCert, p.serverKey = leaf(2, "server", x509.ExtKeyUsageServerAuth)
	p.clientCert, p.clientKey = leaf(3, "client", x509.ExtKeyUsageClientAuth)
	return p
}

// testOperator is a NATS operator with a JetStream account and a system
// account, for a server in operator (JWT) mode, and a user of the account
// with its credentials file.
type testOperator struct {
	operator             string // public key
	resolver             *server.MemAccResolver
	system               string // the system account's public key
	creds, strangerCreds string // a user of the account; a user of an account the server does not know
}

func newTestOperator(t *testing.T) testOperator {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	okp, err := nkeys.CreateOperator()
	must(err)
	opub, err := okp.PublicKey()
	must(err)
	o := testOperator{operator: opub, resolver: &server.MemAccResolver{}}
	account := func(js bool) (nkeys.KeyPair, string) {
		akp, err := nkeys.CreateAccount()
		must(err)
		apub, err := akp.PublicKey()
		must(err)
		ac := jwt.NewAccountClaims(apub)
		if js {
			ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
		}
		ajwt, err := ac.Encode(okp)
		must(err)
		must(o.resolver.Store(apub, ajwt))
		return akp, apub
	}
	user := func(akp nkeys.KeyPair, name string) string {
		ukp, err := nkeys.CreateUser()
		must(err)
		upub, err := ukp.PublicKey()
		must(err)
		seed, err := ukp.Seed()
		must(err)
		ujwt, err := jwt.NewUserClaims(upub).Encode(akp)
		must(err)
		creds, err := jwt.FormatUserConfig(ujwt, seed)
		must(err)
		path := filepath.Join(t.TempDir(), name+".creds")
		must(os.WriteFile(path, creds, 0o600))
		return path
	}
	_, o.system = account(false)
	akp, _ := account(true)
	o.creds = user(akp, "pdq")
	// An account signed by the operator but never given to the server.
	other, err := nkeys.CreateAccount()
	must(err)
	o.strangerCreds = user(other, "stranger")
	return o
}

// serverTLS is the server's side of mutual TLS: its certificate, and
// client certificates signed by the CA required.
func (p testPKI) serverTLS(t *testing.T) *tls.Config {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(p.serverCert, p.serverKey)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(p.ca)
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(raw)
	return &tls.Config{Certificates: []tls.Certificate{cert}, ClientCAs: pool,
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12}
}

// runPDQ runs a pdq command to its end (at most 20 s) and returns its
// exit code and output.
func runPDQ(t *testing.T, env []string, args ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, pdqBinary, args...)
	cmd.Env = append(append(os.Environ(), "PDQ_LOG_FORMAT=json"), env...)
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, string(out)
	case errors.As(err, &exit) && ctx.Err() == nil:
		return exit.ExitCode(), string(out)
	}
	t.Fatalf("pdq %v: %v (did it hang?)\n%s", args, err, out)
	return 0, ""
}

// TestNATSCredentials: against a server that wants credentials (user and
// password, token, a creds file in operator mode, mutual TLS), every
// pdq process (gateway, both workers, the tools) connects with the
// PDQ_NATS_* settings and a request is served; wrong credentials and bad
// files are clear errors at start-up, not endless retries.
func TestNATSCredentials(t *testing.T) {
	pki, other := newTestPKI(t), newTestPKI(t)
	op := newTestOperator(t)
	for _, tc := range []struct {
		name      string
		configure func(*server.Options)
		env       []string      // what every pdq process gets
		opts      []nats.Option // the same, for the test's own connection
		wrong     []string      // credentials the server refuses
		wrongMsg  string
	}{
		{
			name:      "user and password",
			configure: func(o *server.Options) { o.Username, o.Password = "pdq", "s3cret" },
			env:       []string{"PDQ_NATS_USER=pdq", "PDQ_NATS_PASSWORD=s3cret"},
			opts:      []nats.Option{nats.UserInfo("pdq", "s3cret")},
			wrong:     []string{"PDQ_NATS_USER=pdq", "PDQ_NATS_PASSWORD=wrong"},
			wrongMsg:  "authorization violation",
		},
		{
			name:      "token",
			configure: func(o *server.Options) { o.Authorization = "t0ken" },
			env:       []string{"PDQ_NATS_TOKEN=t0ken"},
			opts:      []nats.Option{nats.Token("t0ken")},
			wrong:     []string{"PDQ_NATS_TOKEN=other"},
			wrongMsg:  "authorization violation",
		},
		{
			name: "creds file",
			configure: func(o *server.Options) {
				o.TrustedKeys, o.AccountResolver, o.SystemAccount = []string{op.operator}, op.resolver, op.system
			},
			env:      []string{"PDQ_NATS_CREDS=" + op.creds},
			opts:     []nats.Option{nats.UserCredentials(op.creds)},
			wrong:    []string{"PDQ_NATS_CREDS=" + op.strangerCreds},
			wrongMsg: "authorization violation",
		},
		{
			name: "mutual TLS with a CA",
			configure: func(o *server.Options) {
				o.TLS, o.TLSVerify, o.TLSConfig, o.TLSTimeout = true, true, pki.serverTLS(t), 5
			},
			env:      []string{"PDQ_NATS_CA=" + pki.ca, "PDQ_NATS_CERT=" + pki.clientCert, "PDQ_NATS_KEY=" + pki.clientKey},
			opts:     []nats.Option{nats.RootCAs(pki.ca), nats.ClientCert(pki.clientCert, pki.clientKey)},
			wrong:    []string{"PDQ_NATS_CA=" + other.ca, "PDQ_NATS_CERT=" + pki.clientCert, "PDQ_NATS_KEY=" + pki.clientKey},
			wrongMsg: "certificate signed by unknown authority",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			url := startAuthServer(t, tc.configure)
			c := startClusterOn(t, url, clusterOptions{env: tc.env}, tc.opts...)
			c.worker(dispatcher.StagePrefill, 2)
			c.worker(dispatcher.StageDecode, 2)
			c.ready()
			o := c.one("auth-1", 0, streamed(8)(0))
			if !o.ok {
				t.Errorf("request through a NATS with credentials: %+v", o)
			}
			tool := append([]string{"PDQ_NATS_URL=" + url}, tc.env...)
			if code, out := runPDQ(t, tool, "requests", "auth-1"); code != 0 || !strings.Contains(out, `"state": "done"`) {
				t.Errorf("pdq requests: exit %d\n%s", code, out)
			}
			if code, out := runPDQ(t, tool, "replay", "--failed"); code != 0 || !strings.Contains(out, "0 replayed") {
				t.Errorf("pdq replay --failed: exit %d\n%s", code, out)
			}
			// Without credentials, or with wrong ones: the service stops at
			// once and says why.
			for _, env := range [][]string{tc.wrong, nil} {
				code, out := runPDQ(t, append([]string{"PDQ_NATS_URL=" + url, "PDQ_HTTP_ADDR=127.0.0.1:0"}, env...), "gateway")
				if code != 1 || !strings.Contains(out, "connect to NATS") || !strings.Contains(out, "check PDQ_NATS") {
					t.Errorf("pdq gateway with %q: exit %d; want 1 and a clear error\n%s", env, code, out)
				}
				if !strings.Contains(strings.ToLower(out), tc.wrongMsg) && env != nil {
					t.Errorf("pdq gateway with %q does not say %q:\n%s", env, tc.wrongMsg, out)
				}
			}
			code, out := runPDQ(t, append([]string{"PDQ_NATS_URL=" + url}, tc.wrong...), "requests", "auth-1")
			if code != 1 || !strings.Contains(strings.ToLower(out), tc.wrongMsg) {
				t.Errorf("pdq requests with %q: exit %d\n%s", tc.wrong, code, out)
			}
		})
	}

	t.Run("bad files", func(t *testing.T) {
		notCreds := filepath.Join(t.TempDir(), "x.creds")
		if err := os.WriteFile(notCreds, []byte("not a credentials file"), 0o600); err != nil {
			t.Fatal(err)
		}
		for _, tc := range []struct {
			env  []string
			want string
		}{
			{[]string{"PDQ_NATS_CA=/nonexistent/ca.pem"}, "PDQ_NATS_CA: open /nonexistent/ca.pem"},
			{[]string{"PDQ_NATS_CA=" + notCreds}, "holds no PEM certificate"},
			{[]string{"PDQ_NATS_CREDS=" + notCreds}, "PDQ_NATS_CREDS: " + notCreds + " holds no user"},
			{[]string{"PDQ_NATS_CERT=" + pki.clientCert, "PDQ_NATS_KEY=" + pki.serverKey}, "PDQ_NATS_CERT and PDQ_NATS_KEY"},
			{[]string{"PDQ_NATS_TOKEN=t", "PDQ_NATS_USER=u"}, "set one of"},
		} {
			for _, cmd := range []string{"gateway", "requests"} {
				args := []string{cmd}
				if cmd == "requests" {
					args = append(args, "--failed")
				}
				code, out := runPDQ(t, append([]string{"PDQ_NATS_URL=nats://127.0.0.1:1"}, tc.env...), args...)
				if code != 1 || !strings.Contains(out, tc.want) {
					t.Errorf("pdq %s with %q: exit %d; want 1 and %q\n%s", cmd, tc.env, code, tc.want, out)
				}
			}
		}
	})
}

// TestNATSURLCredentialsNotLogged: credentials in PDQ_NATS_URL (user and
// password, or a token) must never reach a log line, an error or a
// tool's output, whether the server is reached or not.
func TestNATSURLCredentialsNotLogged(t *testing.T) {
	url := startAuthServer(t, func(o *server.Options) { o.Username, o.Password = "pdq", "s3cretpw" })
	withPass := strings.Replace(url, "nats://", "nats://pdq:s3cretpw@", 1)
	outputs := map[string]string{}
	// A gateway that connects, and one that retries a server it cannot
	// reach, with a password and with a token.
	for _, u := range []string{withPass, "nats://pdq:s3cretpw@127.0.0.1:1", "nats://s3cretpw@127.0.0.1:1", "pdq:s3cretpw@127.0.0.1:1"} {
		gw := startPDQ(t, []string{"PDQ_NATS_URL=" + u, "PDQ_HTTP_ADDR=127.0.0.1:0"}, "gateway")
		if u == withPass {
			gw.waitLog(t, "gateway listening")
		} else {
			gw.waitLog(t, "NATS not reachable; retrying")
		}
		gw.stop(t)
		outputs["pdq gateway with "+strings.Replace(u, "s3cretpw", "…", 1)] = gw.output()
	}
	// The tools, which report a server they cannot reach and exit.
	for _, args := range [][]string{{"requests", "--failed"}, {"status"}, {"replay", "--failed"}} {
		for _, u := range []string{withPass, "nats://pdq:s3cretpw@127.0.0.1:1", "nats://s3cretpw@127.0.0.1:1"} {
			_, out := runPDQ(t, []string{"PDQ_NATS_URL=" + u, "PDQ_LOG_LEVEL=debug"}, args...)
			outputs[fmt.Sprintf("pdq %s with %s", strings.Join(args, " "), strings.Replace(u, "s3cretpw", "…", 1))] = out
		}
		_, help := runPDQ(t, []string{"PDQ_NATS_URL=" + withPass}, args[0], "-h")
		outputs["pdq "+args[0]+" -h"] = help
	}
	for what, out := range outputs {
		if strings.Contains(out, "s3cretpw") {
			t.Errorf("%s shows the password:\n%s", what, out)
		}
	}
}

// The upstream Gateway API conformance suite (sigs.k8s.io/gateway-api/conformance),
// run unchanged against seedlink. scripts/build-kube-peers compiles this file
// with `go test -c` into the kube peers' cache; crates/seedlink/tests/gateway_conformance.rs
// runs the binary. Nothing of the suite is copied here: this is its entry point
// plus documented changes to two of its manifests (see derived).
package gwconformance

import (
	"bytes"
	"fmt"
	"io/fs"
	"testing"
	"testing/fstest"

	"sigs.k8s.io/gateway-api/conformance"
	"sigs.k8s.io/yaml"
)

// skipReadiness is the upstream annotation (utils/kubernetes.GatewayExcludedFromReadinessChecks)
// that takes a Gateway out of the suite's "namespace ready" checks.
const skipReadiness = "gateway-api/skip-this-for-readiness"

// rewritten names the suite's manifests this file changes (see derived);
// every other one is used as released.
var rewritten = map[string]bool{
	"base/manifests.yaml": true,
	// v1.7.0: its Gateway has an HTTP listener only; what the test checks
	// (other controllers' conditions kept) holds for any Gateway.
	"tests/gateway-preserve-foreign-conditions.yaml": true,
}

func TestConformance(t *testing.T) {
	opts := conformance.DefaultOptions(t)
	manifests, err := derived()
	if err != nil {
		t.Fatalf("deriving the manifests: %v", err)
	}
	// The suite reads a manifest from every FS that has it, so the derived
	// copy is the only one.
	opts.ManifestFS = []fs.FS{manifests}
	conformance.RunConformanceWithOptions(t, opts)
}

// derived is a copy of the suite's manifests with two changes to the ones
// in rewritten, both for things outside the GATEWAY-TLS profile that
// seedlink does not serve:
//   - a Gateway with no TLS listener (the HTTP and HTTPS Gateways the
//     HTTPRoute tests use, the one of GatewayPreserveForeignConditions) is
//     marked with the suite's own skip-readiness annotation: seedlink
//     honestly reports such a Gateway Accepted=False (UnsupportedProtocol),
//     and the suite's setup would otherwise wait for it to be Programmed;
//   - the coredns Deployment (the UDPRoute tests' DNS backend; its image is
//     not built here) is left out.
func derived() (fs.FS, error) {
	out := fstest.MapFS{}
	err := fs.WalkDir(conformance.Manifests, ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		raw, err := conformance.Manifests.ReadFile(path)
		if err != nil {
			return err
		}
		if rewritten[path] {
			if raw, err = passthrough(raw); err != nil {
				return fmt.Errorf("%s: %w", path, err)
			}
		}
		out[path] = &fstest.MapFile{Data: raw}
		return nil
	})
	return out, err
}

// passthrough is one manifest file with the changes derived describes.
func passthrough(raw []byte) ([]byte, error) {
	var out bytes.Buffer
	for _, doc := range bytes.Split(raw, []byte("\n---\n")) {
		var obj map[string]any
		if err := yaml.Unmarshal(doc, &obj); err != nil {
			return nil, err
		}
		if obj == nil {
			continue
		}
		meta, _ := obj["metadata"].(map[string]any)
		if obj["kind"] == "Deployment" && meta["name"] == "coredns" {
			continue
		}
		if obj["kind"] == "Gateway" && !hasTLSListener(obj) {
			ann, _ := meta["annotations"].(map[string]any)
			if ann == nil {
				ann = map[string]any{}
			}
			ann[skipReadiness] = "true"
			meta["annotations"] = ann
		}
		b, err := yaml.Marshal(obj)
		if err != nil {
			return nil, err
		}
		out.WriteString("---\n")
		out.Write(b)
	}
	return out.Bytes(), nil
}

func hasTLSListener(gw map[string]any) bool {
	spec, _ := gw["spec"].(map[string]any)
	listeners, _ := spec["listeners"].([]any)
	for _, l := range listeners {
		if m, ok := l.(map[string]any); ok && m["protocol"] == "TLS" {
			return true
		}
	}
	return false
}

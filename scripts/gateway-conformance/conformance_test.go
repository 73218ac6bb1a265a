// The upstream Gateway API conformance suite (sigs.k8s.io/gateway-api/conformance),
// run unchanged against seedlink. scripts/build-kube-peers compiles this file
// with `go test -c` into the kube peers' cache; crates/seedlink/tests/gateway_conformance.rs
// runs the binary. Nothing of the suite is copied here: this is its entry point
// plus one documented change to its base manifests (see passthroughBase).
package gwconformance

import (
	"bytes"
	"io/fs"
	"testing"
	"testing/fstest"

	"sigs.k8s.io/gateway-api/conformance"
	"sigs.k8s.io/yaml"
)

// skipReadiness is the upstream annotation (utils/kubernetes.GatewayExcludedFromReadinessChecks)
// that takes a Gateway out of the suite's "namespace ready" checks.
const skipReadiness = "gateway-api/skip-this-for-readiness"

const derivedBase = "seedlink/base-manifests.yaml"

func TestConformance(t *testing.T) {
	opts := conformance.DefaultOptions(t)
	base, err := passthroughBase()
	if err != nil {
		t.Fatalf("deriving the base manifests: %v", err)
	}
	// The suite reads a manifest from every FS that has it, so the derived base
	// lives under its own name.
	opts.ManifestFS = []fs.FS{base, &conformance.Manifests}
	opts.BaseManifests = derivedBase
	conformance.RunConformanceWithOptions(t, opts)
}

// passthroughBase is the suite's base/manifests.yaml with two changes, both
// for things outside the GATEWAY-TLS profile that seedlink does not serve:
//   - a Gateway with no TLS listener (the HTTP and HTTPS Gateways the HTTPRoute
//     tests use) is marked with the suite's own skip-readiness annotation: seedlink
//     honestly reports such a Gateway Accepted=False (UnsupportedProtocol), and the
//     suite's setup would otherwise wait for it to be Programmed;
//   - the coredns Deployment (the UDPRoute tests' DNS backend; its image is not
//     built here) is left out.
func passthroughBase() (fs.FS, error) {
	raw, err := conformance.Manifests.ReadFile("base/manifests.yaml")
	if err != nil {
		return nil, err
	}
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
	return fstest.MapFS{derivedBase: &fstest.MapFile{Data: out.Bytes()}}, nil
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

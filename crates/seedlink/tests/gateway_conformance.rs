//! The upstream Gateway API conformance suite (`sigs.k8s.io/gateway-api/conformance`,
//! the version of the CRDs, built by scripts/build-kube-peers) run against
//! seedlink, profile GATEWAY-TLS, on real Kubernetes: kube-apiserver and etcd,
//! kube-controller-manager (Deployments, ReplicaSets, EndpointSlices,
//! ServiceAccounts, namespace deletion), kube-scheduler, and a real kubelet with containerd,
//! runc and the standard CNI plugins running the suite's own echo server as
//! Pods. Nothing of Kubernetes is a stand-in; what differs from a cloud
//! cluster is in docs/TESTING.md ("The Gateway API conformance run").
//!
//! Everything runs in a network namespace this test makes: the test thread
//! enters it first, so every process it starts (and every thread they
//! start) lives there. Pods are on a bridge in it; each Gateway of the class
//! gets an address of `POOL` on its loopback, where seedlink's one listener
//! (`0.0.0.0:443`) receives it.
//!
//! `SEEDLINK_CONFORMANCE_DIR=<dir>` writes the suite's report and a page listing every test there
//! (docs/conformance/ keeps the one of the last full run).
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use seedlink_testkit::cluster::{peer, run, Cluster, Options};
use seedlink_testkit::{eventually_blocking, Gw};

/// The addresses Gateways of the class get (one each).
const POOL: u8 = 24;

/// The profile's tests seedlink does not run, and why: each needs a Gateway
/// with only HTTP or HTTPS (TLS-terminating) listeners to be Accepted and
/// Programmed before it starts (the suite's namespace readiness check) or
/// checks such a listener's status; seedlink serves TLS passthrough only
/// and reports such a Gateway `Accepted=False` (`UnsupportedProtocol`,
/// `UnsupportedValue`), which is what the spec asks of an implementation
/// that does not support a protocol.
const SKIPPED: &[(&str, &str)] = &[
    (
        "GatewayListenerUnsupportedProtocol",
        "expects an HTTP listener Accepted with HTTPRoute as its kind",
    ),
    ("GatewayInvalidRouteKind", "checks an HTTP listener's kinds"),
    (
        "GatewayInvalidTLSConfiguration",
        "checks HTTPS (TLS-terminating) listeners' certificate references",
    ),
    (
        "GatewayModifyListeners",
        "adds and removes HTTP and HTTPS listeners",
    ),
    (
        "GatewayObservedGenerationBump",
        "needs an HTTP-only Gateway to be Programmed",
    ),
    (
        "GatewaySecretInvalidReferenceGrant",
        "HTTPS listener certificate references",
    ),
    (
        "GatewaySecretMissingReferenceGrant",
        "HTTPS listener certificate references",
    ),
    (
        "GatewaySecretReferenceGrantAllInNamespace",
        "HTTPS listener certificate references",
    ),
    (
        "GatewaySecretReferenceGrantSpecific",
        "HTTPS listener certificate references",
    ),
    (
        "TLSRouteInvalidNoMatchingListener",
        "needs its HTTP-only and HTTPS-only Gateways to be Programmed first",
    ),
];

fn pool() -> Vec<String> {
    (1..=POOL).map(|i| format!("10.250.0.{i}")).collect()
}

/// The tests the suite's log gives `verdict` (`PASS`, `FAIL`), sorted: each
/// test's own line (`    --- PASS: TestConformance/<Name> (..)`), not its
/// subtests'.
fn verdicts<'t>(log: &'t str, verdict: &str) -> Vec<&'t str> {
    let mut names: Vec<&str> = log
        .lines()
        .filter_map(|l| l.strip_prefix("    --- "))
        .filter_map(|l| {
            let (v, rest) = l.split_once(": TestConformance/")?;
            Some((v, rest.split_whitespace().next()?))
        })
        .filter(|(v, name)| *v == verdict && !name.contains('/'))
        .map(|(_, name)| name)
        .collect();
    names.sort_unstable();
    names
}

/// seedlink's GatewayClass and the class-mode install's RBAC (the seed
/// install's roles and the class's, from deploy/kustomize), applied with
/// kubectl; a token of the `seedlink` ServiceAccount.
fn install_class_mode(cluster: &Cluster) -> String {
    let apply = |yaml: &str| {
        let f = cluster.dir.join("apply.yaml");
        std::fs::write(&f, yaml).unwrap();
        let o = cluster.kubectl(&["apply", "-f", f.to_str().unwrap()]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    apply(
        "apiVersion: v1\nkind: Namespace\nmetadata: {name: seedlink-system}\n---\n\
         apiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {name: seedlink}\n\
         spec: {controllerName: seedlink.dev/gateway}\n",
    );
    let root = seedlink_testkit::kubeapi::repo_root();
    let mut rbac = String::new();
    for f in [
        "deploy/kustomize/seed/rbac.yaml",
        "deploy/kustomize/seed-class/rbac-class.yaml",
    ] {
        rbac.push_str(&std::fs::read_to_string(root.join(f)).unwrap());
        rbac.push_str("\n---\n");
    }
    // The namespaced objects of the seed install's RBAC carry no namespace
    // (kustomize sets it): in seedlink-system.
    let f = cluster.dir.join("rbac.yaml");
    std::fs::write(&f, rbac).unwrap();
    let o = cluster.kubectl(&["apply", "-n", "seedlink-system", "-f", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = cluster.kubectl(&[
        "-n",
        "seedlink-system",
        "create",
        "token",
        "seedlink",
        "--duration=2h",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let token = String::from_utf8_lossy(&o.stdout).trim().to_string();
    token
}

/// One version of the suite: its binary in the kube peers' cache, the
/// CRDs installed over the cluster's (none: the cache's own, the CRDs'
/// version), the list of echo image names its manifests use, and the
/// tests expected to pass.
struct Suite {
    version: &'static str,
    bin: &'static str,
    crds: Option<&'static str>,
    echo_names: &'static str,
    /// Tests expected to pass besides [`PASSED`].
    also_passed: &'static [&'static str],
    /// Where under `SEEDLINK_CONFORMANCE_DIR` its report goes.
    docs: &'static str,
}

/// The suites run one after another: each starts a cluster of its own.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn the_gateway_api_conformance_suite_passes_the_gateway_tls_profile() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    conform(&Suite {
        version: "the CRDs' version",
        bin: "bin/gateway-conformance",
        crds: None,
        echo_names: "images/echo-basic.names",
        also_passed: &[],
        docs: "",
    });
}

/// Gateway API v1.7.0's suite, with v1.7.0's CRDs installed over the
/// cluster's.
#[test]
fn the_gateway_api_v1_7_conformance_suite_passes_the_gateway_tls_profile() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    conform(&Suite {
        version: "v1.7.0, its CRDs installed over the CRDs' version",
        bin: "bin/gateway-conformance-v1.7.0",
        crds: Some("crds/gateway-api-v1.7.0"),
        echo_names: "images/echo-basic-v1.7.0.names",
        also_passed: ALSO_PASSED_V1_7,
        docs: "v1.7.0",
    });
}

/// A cluster with seedlink installed in class mode, `suite` run against it.
fn conform(suite: &Suite) {
    let kube = seedlink_testkit::kubeapi::kube_dir();
    let bin = peer(&kube, suite.bin);
    let echo = peer(&kube, "images/echo-basic.oci.tar");
    let echo_names = std::fs::read_to_string(peer(&kube, suite.echo_names)).unwrap();
    let cluster = Cluster::start(Options {
        addresses: pool(),
        kube_proxy: false,
        prefix: "slgc",
    });
    cluster.import_image(&echo);
    for n in echo_names.split_whitespace() {
        run(&mut cluster.ctr(&["images", "tag", "--force", "localhost/echo-basic:built", n]));
    }
    if let Some(crds) = suite.crds {
        let dir = peer(&kube, crds);
        let o = cluster.kubectl(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            dir.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let _gw = start_seedlink(&cluster);
    let (status, text, report_text) = run_suite(&cluster, &bin);
    let (passed, failed) = (verdicts(&text, "PASS"), verdicts(&text, "FAIL"));
    if let Ok(to) = std::env::var("SEEDLINK_CONFORMANCE_DIR") {
        let docs = Path::new(&to).join(suite.docs);
        write_docs(&docs, suite.version, &report_text, &passed, &failed);
    }
    assert!(
        status.success() && failed.is_empty(),
        "the conformance suite ({}) failed ({status}): {failed:?}\nlogs in {}\n{}",
        suite.version,
        cluster.dir.display(),
        text.lines()
            .rev()
            .take(60)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    );
    let mut expected: Vec<&str> = PASSED.iter().chain(suite.also_passed).copied().collect();
    expected.sort_unstable();
    assert_eq!(
        passed, expected,
        "the tests that pass ({}) changed: update the lists and docs/conformance/",
        suite.version
    );
    check_report(&report_text, expected.len());
}

/// seedlink: its GatewayClass, and the gateway serving every Gateway of
/// it, as installed: the `seedlink` ServiceAccount with the RBAC of the
/// class-mode install (deploy/kustomize/seed-class: the seed install's
/// roles and the class's), its own token; never the admin's. Serving once
/// it declares its features.
fn start_seedlink(cluster: &Cluster) -> Gw {
    let token = install_class_mode(cluster);
    let installed = cluster
        .api
        .kubeconfig(&cluster.dir, "seedlink", &token, None);
    let installed = installed.display().to_string();
    let gw = Gw::start_with_env(
        &format!(
            "admin: {{listen: '127.0.0.1:0'}}
listeners: [{{name: tls, address: '0.0.0.0:443'}}]
kubernetes:
  gateway_class: {{name: seedlink, addresses: [{}]}}
  lease: seedlink-system/seedlink-status
",
            pool().join(", ")
        ),
        &[("KUBECONFIG", &installed), ("POD_NAME", "seedlink-0")],
    );
    eventually_blocking(
        "seedlink declares its features",
        Duration::from_secs(60),
        || {
            let o = cluster.kubectl(&[
                "get",
                "gatewayclass",
                "seedlink",
                "-o",
                "jsonpath={.status.supportedFeatures[*].name}",
            ]);
            let names = String::from_utf8_lossy(&o.stdout).into_owned();
            (names.trim() == "Gateway ReferenceGrant TLSRoute")
                .then_some(())
                .ok_or(names)
        },
    );
    gw
}

/// The suite, as its own docs run it; the supported features it reads
/// from the GatewayClass's status, where seedlink declares them. Its exit
/// status, its log and its report.
fn run_suite(cluster: &Cluster, bin: &Path) -> (std::process::ExitStatus, String, String) {
    let dir = &cluster.dir;
    let admin = cluster.api.admin_kubeconfig.display().to_string();
    let report = dir.join("report.yaml");
    let skip: Vec<&str> = SKIPPED.iter().map(|(t, _)| *t).collect();
    let status = Command::new(bin)
        .env("KUBECONFIG", &admin)
        .args([
            "-test.run",
            "TestConformance",
            "-test.v",
            "-test.timeout",
            "45m",
        ])
        .args([
            "-gateway-class",
            "seedlink",
            "-conformance-profiles",
            "GATEWAY-TLS",
        ])
        .args(["-skip-tests", &skip.join(",")])
        .arg(format!("-report-output={}", report.display()))
        .args(["-organization", "seedlink", "-project", "seedlink"])
        .args([
            "-url",
            "https://seedlink.dev",
            "-contact",
            "seedlink maintainers",
        ])
        .args(["-version", env!("CARGO_PKG_VERSION"), "-mode", "default"])
        .stdout(cluster.log("conformance.log"))
        .stderr(cluster.log("conformance.stderr.log"))
        .status()
        .unwrap();
    let text = std::fs::read_to_string(dir.join("conformance.log")).unwrap_or_default();
    (
        status,
        text,
        std::fs::read_to_string(&report).unwrap_or_default(),
    )
}

/// The report: the profile's core tests all passed but the ones skipped,
/// and why.
fn check_report(report_text: &str, passed: usize) {
    for needle in [
        "name: GATEWAY-TLS".to_string(),
        "Failed: 0".to_string(),
        format!("Passed: {passed}"),
        format!("Skipped: {}", SKIPPED.len()),
    ] {
        assert!(
            report_text.contains(&needle),
            "{needle:?} not in the report:\n{report_text}"
        );
    }
    for (t, _) in SKIPPED {
        assert!(
            report_text.contains(&format!("- {t}\n")),
            "{t} not skipped in:\n{report_text}"
        );
    }
}

/// The profile's tests that pass (all of GATEWAY-TLS's core tests that
/// apply to TLS passthrough).
const PASSED: &[&str] = &[
    "GatewayClassObservedGenerationBump",
    "TLSRouteHostnameIntersection",
    "TLSRouteInvalidBackendRefNonexistent",
    "TLSRouteInvalidBackendRefUnknownKind",
    "TLSRouteInvalidNoMatchingListenerHostname",
    "TLSRouteInvalidReferenceGrant",
    "TLSRouteListenerPassthroughSupportedKinds",
    "TLSRouteListenerTerminateNotSupported",
    "TLSRouteSimpleSameNamespace",
];

/// What v1.7.0's suite passes besides [`PASSED`]: its new Gateway tests
/// (GatewayPreserveForeignConditions on a Gateway with an HTTP listener
/// only, which it checks all the same: see conformance_test.go).
const ALSO_PASSED_V1_7: &[&str] = &[
    "GatewayNameMaximumLength",
    "GatewayPreserveForeignConditions",
];

/// docs/conformance/: the suite's report as it wrote it, and a page that
/// lists every test of the profile with its result (and, if skipped, why).
fn write_docs(dir: &Path, version: &str, report: &str, passed: &[&str], failed: &[&str]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join(format!(
            "seedlink-{}-default-report.yaml",
            env!("CARGO_PKG_VERSION")
        )),
        report,
    )
    .unwrap();
    let mut md = format!(
        "# Gateway API conformance: GATEWAY-TLS ({version})\n\n\
         Written by `SEEDLINK_CONFORMANCE_DIR=docs/conformance cargo test -p seedlink --test gateway_conformance`\n\
         (the same run is part of the README's test command); the report beside this page is the\n\
         suite's own (`sigs.k8s.io/gateway-api/conformance`, {version}), unchanged.\n\n\
         Supported features, as seedlink declares them in the GatewayClass's `status.supportedFeatures`\n\
         (which the suite reads): `Gateway`, `ReferenceGrant`, `TLSRoute` (TLS passthrough).\n\
         Not declared: `TLSRouteModeTerminate`, `TLSRouteModeMixed` (seedlink never terminates TLS),\n\
         and every HTTP, gRPC, TCP, UDP and mesh feature.\n\n\
         | test | result | why skipped |\n|---|---|---|\n",
    );
    let mut rows: Vec<(String, String, String)> = passed
        .iter()
        .map(|t| (t.to_string(), "passed".to_string(), String::new()))
        .chain(
            failed
                .iter()
                .map(|t| (t.to_string(), "**failed**".to_string(), String::new())),
        )
        .chain(
            SKIPPED
                .iter()
                .map(|(t, why)| (t.to_string(), "skipped".to_string(), why.to_string())),
        )
        .collect();
    rows.sort();
    for (t, r, why) in rows {
        md.push_str(&format!("| {t} | {r} | {why} |\n"));
    }
    md.push_str(
        "\nEvery skipped test needs a Gateway with only HTTP or HTTPS (TLS-terminating)\n\
         listeners to be Accepted and Programmed, or checks such a listener; seedlink serves\n\
         TLS passthrough only and reports such a Gateway `Accepted=False` with\n\
         `UnsupportedProtocol` or `UnsupportedValue` on the listener, as the spec asks.\n\
         What stands in for what in this run: docs/TESTING.md, \"The Gateway API conformance run\".\n",
    );
    std::fs::write(dir.join("README.md"), md).unwrap();
}

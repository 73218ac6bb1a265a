//! The Konnectivity metric mapping in docs/TUNNEL.md is what a running
//! tunnel-server exports: every row marked "same" is present with
//! upstream's name and type, the reason values are upstream's, every
//! configured cluster has its series from the start, and the process and
//! build metrics are there.
#![allow(missing_docs, clippy::unwrap_used, clippy::expect_used)]

use seedlink_testkit as common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::tunnel_env::{kas_connect, kas_connect_eventually, ready_line};
use common::*;
use tokio_util::sync::CancellationToken;

/// (name, type) of the "same" rows of the mapping table.
fn documented() -> Vec<(String, String)> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/TUNNEL.md"))
            .unwrap();
    let start = doc
        .find("### Konnectivity's server metrics")
        .expect("the mapping section");
    let mut out = Vec::new();
    for line in doc[start..]
        .lines()
        .skip_while(|l| !l.starts_with("| upstream"))
        .skip(2)
    {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if !cells[2].starts_with("same") {
            continue;
        }
        let name = cells[0].trim_matches('`');
        let name = name.split('{').next().unwrap().to_string();
        out.push((name, cells[1].to_string()));
    }
    assert!(out.len() >= 5, "the table lost rows: {out:?}");
    out
}

fn metric(text: &str, prefix: &str) -> f64 {
    sum_metric(text, prefix)
}

/// The tunnel-server's file: clusters `shoot--a` (agents of `shoot`'s CA)
/// and `shoot--b` (of `other`'s), each with a Unix-socket frontend in `d`.
fn two_cluster_config(
    d: &std::path::Path,
    seed: &seedlink::demo::Pki,
    shoot: &seedlink::demo::Pki,
    other: &seedlink::demo::Pki,
) -> std::path::PathBuf {
    let w = |name: &str, text: &str| {
        std::fs::write(d.join(name), text).unwrap();
        d.join(name).display().to_string()
    };
    let config = d.join("tunnel.yaml");
    std::fs::write(
        &config,
        format!(
            "agents: {{listen: '127.0.0.1:0', cert: '{}', key: '{}'}}
admin: {{listen: '127.0.0.1:0'}}
dial_timeout: 5s
clusters:
  - {{name: shoot--a, agent_ca: '{}', frontends: [{{name: kas, protocol: http-connect, unix: '{}/a.sock'}}]}}
  - {{name: shoot--b, agent_ca: '{}', frontends: [{{name: kas, protocol: http-connect, unix: '{}/b.sock'}}]}}
",
            w("tun.pem", &seed.servers[0].1.cert_pem),
            w("tun-key.pem", &seed.servers[0].1.key_pem),
            w("a-ca.pem", &shoot.ca_pem),
            d.display(),
            w("b-ca.pem", &other.ca_pem),
            d.display(),
        ),
    )
    .unwrap();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_konnectivity_metrics_are_exported() {
    let stop = CancellationToken::new();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let w = |name: &str, text: &str| {
        std::fs::write(d.join(name), text).unwrap();
        d.join(name).display().to_string()
    };
    let seed = seedlink::demo::Pki::generate(&["tunnel.seedlink.test"]).unwrap();
    let shoot = seedlink::demo::Pki::generate(&[]).unwrap();
    let other = seedlink::demo::Pki::generate(&[]).unwrap();
    let seed_ca = w("seed-ca.pem", &seed.ca_pem);
    let config = two_cluster_config(d, &seed, &shoot, &other);
    let mut server = Command::new(seedlink_bin())
        .args(["tunnel-server", "--config"])
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let ready = ready_line(&mut server);
    let _server = Proc(server);
    let admin: std::net::SocketAddr = ready["admin"].as_str().unwrap().parse().unwrap();

    // Before any agent: every cluster's series, at zero.
    let m = http_get(admin, "/metrics").await.1;
    for c in ["shoot--a", "shoot--b"] {
        assert!(
            m.contains(&format!(
                "seedlink_tunnel_server_agents{{cluster=\"{c}\"}} 0"
            )),
            "{c} has no agents series:\n{m}"
        );
    }
    assert!(m.contains("seedlink_build_info{"), "{m}");
    assert!(m.contains("\nseedlink_panics_total 0\n"), "{m}");
    assert!(metric(&m, "seedlink_runtime_tasks") > 0.0, "{m}");
    assert!(m.contains("\nprocess_cpu_seconds_total "), "{m}");
    for p in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(metric(&m, p) > 0.0, "{p}:\n{m}");
    }

    // An agent for a; a dial that works, one the agent cannot make, and one
    // to b, which has no agent.
    let mut agent = seedlink_testkit::agent_cmd::AgentCmd::new(ready["agents"].as_str().unwrap())
        .mtls(
            &seed_ca,
            &w("a.pem", &shoot.client.cert_pem),
            &w("a-key.pem", &shoot.client.key_pem),
        )
        .fast_sync()
        .command()
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let _ = ready_line(&mut agent);
    let _agent = Proc(agent);
    let echo = echo_backend(&stop).await;
    let sock_a = d.join("a.sock").display().to_string();
    let mut s = kas_connect_eventually(&sock_a, &echo.to_string(), Duration::from_secs(20)).await;
    common::tunnel_env::echo_rtt(&mut s, 10).await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    assert!(kas_connect(&sock_a, &closed.to_string()).await.is_err());
    assert!(
        kas_connect(&d.join("b.sock").display().to_string(), &echo.to_string())
            .await
            .is_err()
    );

    // The refused frontend connections end a moment after their answers:
    // wait (bounded) until only the open tunnel's connection is left.
    let k = "konnectivity_network_proxy_server_";
    let m = eventually(
        "http_connections at 1",
        Duration::from_secs(10),
        async || {
            let m = http_get(admin, "/metrics").await.1;
            if metric(&m, &format!("{k}http_connections")) == 1.0 {
                Ok(m)
            } else {
                Err(m)
            }
        },
    )
    .await;
    for (name, kind) in documented() {
        let full = format!("konnectivity_network_proxy_server_{name}");
        assert!(
            m.contains(&format!("# TYPE {full} {kind}\n")),
            "{full} ({kind}) is documented as exported:\n{m}"
        );
    }
    assert!(
        metric(&m, &format!("{k}dial_duration_seconds_count")) >= 1.0,
        "{m}"
    );
    assert!(
        metric(
            &m,
            &format!("{k}dial_failure_count_total{{reason=\"error_response\"}}")
        ) >= 1.0,
        "{m}"
    );
    assert!(
        metric(
            &m,
            &format!("{k}dial_failure_count_total{{reason=\"no_agent\"}}")
        ) >= 1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, &format!("{k}established_connections")),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(&m, &format!("{k}ready_backend_connections")),
        1.0,
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            &format!("{k}grpc_connections{{service_method=\"Connect\"}}")
        ),
        1.0,
        "{m}"
    );
    // The open tunnel's frontend connection.
    assert_eq!(metric(&m, &format!("{k}http_connections")), 1.0, "{m}");
    assert!(
        m.contains("seedlink_tunnel_server_agents{cluster=\"shoot--b\"} 0"),
        "{m}"
    );
    drop(s);
    stop.cancel();
}

//! Squid as an HTTPS forward proxy: its `https_port` speaks TLS to the
//! client and takes `CONNECT` inside it, and its own `basic_ncsa_auth`
//! helper checks Basic credentials (`user:s3cret-pw`), as a corporate
//! proxy on an https:// address does.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The password Squid accepts for `user`.
pub const PASSWORD: &str = "s3cret-pw";

/// A Squid configuration and what a client needs to trust it.
pub struct Squid {
    /// Its configuration file.
    pub conf: PathBuf,
    /// The CA that issued its certificate (for `127.0.0.1`, `::1` and
    /// `proxy.egress.test`).
    pub ca: PathBuf,
    /// Its access log: one line per CONNECT, with the target.
    pub access_log: PathBuf,
    /// Its cache log (startup, helpers, errors).
    pub cache_log: PathBuf,
}

impl Squid {
    /// Squid's files in `<parent>/squid`, listening on `listen` with TLS,
    /// allowing CONNECT to `ports` only, for `user` with [`PASSWORD`].
    /// Squid drops root for the `proxy` user, so `parent` is made
    /// traversable and these files readable by it (test keys only).
    pub fn files(parent: &Path, listen: SocketAddr, ports: &[u16]) -> Squid {
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o711)).unwrap();
        let dir = parent.join("squid");
        std::fs::create_dir_all(dir.join("logs")).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(dir.join("logs"), std::fs::Permissions::from_mode(0o777)).unwrap();
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "egress proxy test CA");
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let names = vec![
            "proxy.egress.test".to_string(),
            "127.0.0.1".to_string(),
            "::1".to_string(),
        ];
        let cert = rcgen::CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let write = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
            p
        };
        let ca = write("ca.pem", &ca_cert.pem());
        let cert = write("cert.pem", &cert.pem());
        let key = write("key.pem", &key.serialize_pem());
        let hash = Command::new(crate::require("openssl"))
            .args(["passwd", "-apr1", PASSWORD])
            .output()
            .unwrap();
        assert!(hash.status.success(), "{hash:?}");
        let passwd = write(
            "passwd",
            &format!("user:{}", String::from_utf8_lossy(&hash.stdout)),
        );
        let acls: String = ports
            .iter()
            .map(|p| format!("acl allowed port {p}\n"))
            .collect();
        let logs = dir.join("logs");
        let text = format!(
            "https_port {listen} tls-cert={cert} tls-key={key}
auth_param basic program {helper} {passwd}
auth_param basic realm seedlink-test
auth_param basic credentialsttl 1 second
acl authed proxy_auth REQUIRED
acl CONNECT method CONNECT
{acls}http_access deny !authed
http_access allow CONNECT allowed
http_access deny all
pid_filename none
cache_log {logs}/cache.log
access_log stdio:{logs}/access.log
cache deny all
coredump_dir {logs}
visible_hostname seedlink-test
netdb_filename none
pinger_enable off
shutdown_lifetime 0 seconds
",
            cert = cert.display(),
            key = key.display(),
            helper = "/usr/lib/squid/basic_ncsa_auth",
            passwd = passwd.display(),
            logs = logs.display(),
        );
        let conf = write("squid.conf", &text);
        Squid {
            conf,
            ca,
            access_log: logs.join("access.log"),
            cache_log: logs.join("cache.log"),
        }
    }

    /// The arguments that run Squid in the foreground on this
    /// configuration (after the binary: `squid -N -f <conf>`).
    pub fn args(&self) -> Vec<String> {
        vec![
            crate::require("squid").display().to_string(),
            "-N".into(),
            "-f".into(),
            self.conf.display().to_string(),
        ]
    }

    /// Squid on this configuration, on this machine's network.
    pub fn spawn(&self) -> crate::Proc {
        let args = self.args();
        crate::Proc(
            Command::new(&args[0])
                .args(&args[1..])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }

    /// The access log so far (empty before the first request).
    pub fn seen(&self) -> String {
        std::fs::read_to_string(&self.access_log).unwrap_or_default()
    }
}

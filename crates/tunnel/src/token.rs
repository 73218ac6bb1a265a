//! ServiceAccount token authentication of agents, validated locally: the
//! signature against the issuer's public keys (PEM, as in the API server's
//! `--service-account-key-file`), the issuer, the audience (Konnectivity's
//! convention `system:konnectivity-server`), the expiry and the subject
//! `system:serviceaccount:<namespace>:<name>`. Each cluster has its own
//! issuer keys, so a token decides its cluster; no API server is asked.

use std::path::Path;

use anyhow::Context;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

/// How one cluster's agent tokens are checked.
pub struct TokenValidator {
    keys: Vec<(DecodingKey, Vec<Algorithm>)>,
    validation_base: (String, String),
    subject: String,
}

/// Why a token was refused (for logs and metrics; the agent only learns
/// that it was refused).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not `Bearer <token>`.
    #[error("authorization is not 'Bearer <token>'")]
    Malformed,
    /// Signature, issuer, audience or expiry wrong.
    #[error("token rejected: {0}")]
    Invalid(String),
    /// Signed and valid, but for another ServiceAccount.
    #[error("token is for {0}, not the agent's ServiceAccount")]
    WrongSubject(String),
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
}

/// Reads every PEM public key (RSA or EC) in `path`.
fn load_keys(path: &Path) -> anyhow::Result<Vec<(DecodingKey, Vec<Algorithm>)>> {
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for block in split_pem(&text) {
        if let Ok(k) = DecodingKey::from_rsa_pem(&block) {
            out.push((
                k,
                vec![Algorithm::RS256, Algorithm::RS384, Algorithm::RS512],
            ));
        } else if let Ok(k) = DecodingKey::from_ec_pem(&block) {
            out.push((k, vec![Algorithm::ES256, Algorithm::ES384]));
        } else {
            anyhow::bail!(
                "{}: a PEM block is neither an RSA nor an EC public key",
                path.display()
            );
        }
    }
    if out.is_empty() {
        anyhow::bail!("{}: no public key found", path.display());
    }
    Ok(out)
}

/// Splits a file into its PEM blocks.
fn split_pem(text: &[u8]) -> Vec<Vec<u8>> {
    let s = String::from_utf8_lossy(text);
    let mut blocks = Vec::new();
    let mut cur = String::new();
    for line in s.lines() {
        if line.starts_with("-----BEGIN ") {
            cur.clear();
        }
        cur.push_str(line);
        cur.push('\n');
        if line.starts_with("-----END ") {
            blocks.push(cur.clone().into_bytes());
        }
    }
    blocks
}

impl TokenValidator {
    /// A validator for tokens of `issuer` signed by a key in `keys`,
    /// for `audience`, of ServiceAccount `namespace/name`.
    pub fn new(
        keys: &Path,
        issuer: &str,
        audience: &str,
        service_account: &str,
    ) -> anyhow::Result<TokenValidator> {
        let (ns, name) = service_account
            .split_once('/')
            .context("service_account must be <namespace>/<name>")?;
        Ok(TokenValidator {
            keys: load_keys(keys)?,
            validation_base: (issuer.to_string(), audience.to_string()),
            subject: format!("system:serviceaccount:{ns}:{name}"),
        })
    }

    /// Checks an `authorization` header value.
    pub fn check(&self, authorization: &str) -> Result<(), TokenError> {
        let token = authorization
            .strip_prefix("Bearer ")
            .filter(|t| !t.is_empty())
            .ok_or(TokenError::Malformed)?;
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| TokenError::Invalid(e.to_string()))?;
        let mut last = TokenError::Invalid("no key for the token's algorithm".into());
        for (key, algs) in &self.keys {
            if !algs.contains(&header.alg) {
                continue;
            }
            let mut v = Validation::new(header.alg);
            v.set_issuer(&[&self.validation_base.0]);
            v.set_audience(&[&self.validation_base.1]);
            v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
            v.leeway = 30;
            match jsonwebtoken::decode::<Claims>(token, key, &v) {
                Ok(data) if data.claims.sub == self.subject => return Ok(()),
                Ok(data) => return Err(TokenError::WrongSubject(data.claims.sub)),
                Err(e) => last = TokenError::Invalid(e.to_string()),
            }
        }
        Err(last)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn key() -> (String, String) {
        let kp = rcgen::KeyPair::generate().unwrap();
        (kp.serialize_pem(), kp.public_key_pem())
    }

    fn sign(private: &str, claims: serde_json::Value) -> String {
        let k = jsonwebtoken::EncodingKey::from_ec_pem(private.as_bytes()).unwrap();
        jsonwebtoken::encode(&jsonwebtoken::Header::new(Algorithm::ES256), &claims, &k).unwrap()
    }

    fn now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    }

    #[test]
    fn valid_wrong_audience_expired_wrong_key_wrong_subject() {
        let dir = tempfile::tempdir().unwrap();
        let (private, public) = key();
        let (other_private, _) = key();
        let p = dir.path().join("sa.pub");
        std::fs::write(&p, &public).unwrap();
        let v = TokenValidator::new(
            &p,
            "https://issuer.a",
            "system:konnectivity-server",
            "kube-system/konnectivity-agent",
        )
        .unwrap();
        let good = serde_json::json!({"iss": "https://issuer.a", "aud": ["system:konnectivity-server"], "exp": now() + 600, "sub": "system:serviceaccount:kube-system:konnectivity-agent"});
        assert_eq!(
            v.check(&format!("Bearer {}", sign(&private, good.clone()))),
            Ok(())
        );
        let mut c = good.clone();
        c["aud"] = serde_json::json!(["api"]);
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&private, c))),
            Err(TokenError::Invalid(_))
        ));
        let mut c = good.clone();
        c["exp"] = serde_json::json!(now() - 3600);
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&private, c))),
            Err(TokenError::Invalid(_))
        ));
        let mut c = good.clone();
        c["iss"] = serde_json::json!("https://issuer.b");
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&private, c))),
            Err(TokenError::Invalid(_))
        ));
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&other_private, good.clone()))),
            Err(TokenError::Invalid(_))
        ));
        let mut c = good;
        c["sub"] = serde_json::json!("system:serviceaccount:default:default");
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&private, c))),
            Err(TokenError::WrongSubject(_))
        ));
        assert_eq!(v.check("Basic abc"), Err(TokenError::Malformed));
        assert!(matches!(
            v.check("Bearer not.a.jwt"),
            Err(TokenError::Invalid(_))
        ));
    }
}

//! ServiceAccount token authentication of agents. A token is routed to the
//! cluster whose configured issuer equals its (not yet verified) `iss`
//! claim, and only that cluster checks it, in one of two ways:
//! - locally: the signature against the issuer's public keys (PEM, as in
//!   the API server's `--service-account-key-file`), the issuer, the
//!   audience (Konnectivity's convention `system:konnectivity-server`), the
//!   expiry and the subject `system:serviceaccount:<namespace>:<name>`; no
//!   API server is asked;
//! - by a TokenReview at that cluster's API server (`tokenreview.rs`), which
//!   also honours revocation (a deleted ServiceAccount or pod).

use std::path::Path;

use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use crate::auth::token_review::TokenReviewer;

/// How one cluster's agent tokens are checked.
pub struct TokenValidator {
    issuer: String,
    audience: String,
    subject: String,
    method: Method,
}

enum Method {
    Local(Vec<(DecodingKey, Vec<Algorithm>)>),
    Review(Box<TokenReviewer>),
}

pub use crate::auth::token_error::{AuthSetupError, TokenError};

#[derive(Deserialize)]
struct Claims {
    sub: String,
}

/// Claims read before the token is verified: only used to route it to the
/// cluster that then verifies it.
#[derive(Deserialize)]
struct Unverified {
    iss: String,
    #[serde(default)]
    exp: Option<u64>,
    #[serde(default)]
    sub: String,
    #[serde(default)]
    aud: Audience,
}

/// `aud`: one string or a list (RFC 7519 §4.1.3).
#[derive(serde::Deserialize, Default)]
#[serde(untagged)]
enum Audience {
    #[default]
    None,
    One(String),
    Many(Vec<String>),
}

impl Audience {
    fn contains(&self, a: &str) -> bool {
        match self {
            Audience::None => false,
            Audience::One(x) => x == a,
            Audience::Many(v) => v.iter().any(|x| x == a),
        }
    }
}

/// The bearer token in an `authorization` value.
pub fn bearer(authorization: &str) -> Result<&str, TokenError> {
    authorization
        .strip_prefix("Bearer ")
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or(TokenError::Malformed)
}

/// The token's `iss` and `exp`, without checking anything (only to pick
/// the cluster whose keys or TokenReview then check it).
fn unverified(token: &str) -> Result<Unverified, TokenError> {
    jsonwebtoken::dangerous::insecure_decode::<Unverified>(token)
        .map(|d| d.claims)
        .map_err(|e| TokenError::Invalid(format!("not a ServiceAccount token: {e}")))
}

/// The issuer a token claims (to route it to its cluster).
pub fn claimed_issuer(authorization: &str) -> Result<String, TokenError> {
    Ok(unverified(bearer(authorization)?)?.iss)
}

/// Reads every PEM public key (RSA or EC) in `path`.
pub(crate) fn load_keys(path: &Path) -> Result<Vec<(DecodingKey, Vec<Algorithm>)>, AuthSetupError> {
    let text = std::fs::read(path).map_err(|source| AuthSetupError::Read {
        path: path.display().to_string(),
        source,
    })?;
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
            return Err(AuthSetupError::NotAKey(path.display().to_string()));
        }
    }
    if out.is_empty() {
        return Err(AuthSetupError::NoKey(path.display().to_string()));
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
    /// Checks tokens of `issuer` locally against the public keys in `keys`,
    /// for `audience`, of ServiceAccount `namespace/name`.
    pub fn new(
        keys: &Path,
        issuer: &str,
        audience: &str,
        service_account: &str,
    ) -> Result<TokenValidator, AuthSetupError> {
        Self::build(
            Method::Local(load_keys(keys)?),
            issuer,
            audience,
            service_account,
        )
    }

    /// Checks tokens of `issuer` by TokenReview at the cluster's API server.
    pub fn with_review(
        reviewer: TokenReviewer,
        issuer: &str,
        audience: &str,
        service_account: &str,
    ) -> Result<TokenValidator, AuthSetupError> {
        Self::build(
            Method::Review(Box::new(reviewer)),
            issuer,
            audience,
            service_account,
        )
    }

    fn build(
        method: Method,
        issuer: &str,
        audience: &str,
        service_account: &str,
    ) -> Result<TokenValidator, AuthSetupError> {
        let (ns, name) = service_account
            .split_once('/')
            .ok_or(AuthSetupError::ServiceAccount)?;
        Ok(TokenValidator {
            issuer: issuer.to_string(),
            audience: audience.to_string(),
            subject: format!("system:serviceaccount:{ns}:{name}"),
            method,
        })
    }

    /// The issuer whose tokens this checks.
    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// Checks an `authorization` header value.
    pub async fn check(&self, authorization: &str) -> Result<(), TokenError> {
        let token = bearer(authorization)?;
        match &self.method {
            Method::Local(keys) => self.check_local(keys, token),
            Method::Review(r) => {
                let claims = unverified(token)?;
                if claims.iss != self.issuer {
                    return Err(TokenError::Invalid(format!(
                        "issuer {:?} is not {:?}",
                        claims.iss, self.issuer
                    )));
                }
                // What the review would refuse anyway is refused here,
                // without spending the cluster's review budget on it.
                self.precheck(&claims)?;
                r.check(token, &self.audience, &self.subject, claims.exp)
                    .await
            }
        }
    }

    /// The claims a TokenReview'd token must carry, read unverified: the
    /// audience, the ServiceAccount, and an `exp` not past (30 s leeway).
    fn precheck(&self, claims: &Unverified) -> Result<(), TokenError> {
        if !claims.aud.contains(&self.audience) {
            return Err(TokenError::Invalid(format!(
                "audience is not {:?}",
                self.audience
            )));
        }
        if claims.sub != self.subject {
            return Err(TokenError::WrongSubject(claims.sub.clone()));
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        match claims.exp {
            Some(exp) if exp.saturating_add(30) < now => {
                Err(TokenError::Invalid("token expired".into()))
            }
            Some(_) => Ok(()),
            None => Err(TokenError::Invalid("token without exp".into())),
        }
    }

    fn check_local(
        &self,
        keys: &[(DecodingKey, Vec<Algorithm>)],
        token: &str,
    ) -> Result<(), TokenError> {
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| TokenError::Invalid(e.to_string()))?;
        let mut last = TokenError::Invalid("no key for the token's algorithm".into());
        for (key, algs) in keys {
            if !algs.contains(&header.alg) {
                continue;
            }
            let mut v = Validation::new(header.alg);
            v.set_issuer(&[&self.issuer]);
            v.set_audience(&[&self.audience]);
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

    #[tokio::test]
    async fn valid_wrong_audience_expired_wrong_key_wrong_subject() {
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
            v.check(&format!("Bearer {}", sign(&private, good.clone())))
                .await,
            Ok(())
        );
        let mut c = good.clone();
        c["aud"] = serde_json::json!(["api"]);
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&private, c))).await,
            Err(TokenError::Invalid(_))
        ));
        let mut c = good.clone();
        c["exp"] = serde_json::json!(now() - 3600);
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&private, c))).await,
            Err(TokenError::Invalid(_))
        ));
        let mut c = good.clone();
        c["iss"] = serde_json::json!("https://issuer.b");
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&private, c))).await,
            Err(TokenError::Invalid(_))
        ));
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&other_private, good.clone())))
                .await,
            Err(TokenError::Invalid(_))
        ));
        let mut c = good;
        c["sub"] = serde_json::json!("system:serviceaccount:default:default");
        assert!(matches!(
            v.check(&format!("Bearer {}", sign(&private, c))).await,
            Err(TokenError::WrongSubject(_))
        ));
        assert_eq!(v.check("Basic abc").await, Err(TokenError::Malformed));
        assert!(matches!(
            v.check("Bearer not.a.jwt").await,
            Err(TokenError::Invalid(_))
        ));
    }

    /// A token carrying a cluster's issuer but refused by what its claims
    /// say (audience, ServiceAccount, expiry) never reaches the cluster's
    /// TokenReview: forged tokens cannot spend that cluster's review budget.
    /// Here the review endpoint does not exist, so a token that reached it
    /// would come back `Unavailable`.
    #[tokio::test]
    async fn forged_tokens_are_refused_before_a_review() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let c = rcgen::generate_simple_self_signed(vec!["x".to_string()]).unwrap();
        std::fs::write(&ca, c.cert.pem()).unwrap();
        let tf = dir.path().join("t");
        std::fs::write(&tf, "reviewer-token").unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let s2 = seen.clone();
        let reviewer = TokenReviewer::new(
            &crate::auth::token_review::TokenReview {
                url: "https://127.0.0.1:1".into(),
                ca,
                token_file: Some(tf),
                cert: None,
                key: None,
                timeout: std::time::Duration::from_secs(2),
                cache_ttl: std::time::Duration::from_secs(60),
            },
            std::sync::Arc::new(move |o: &str| s2.lock().unwrap().push(o.to_string())),
        )
        .unwrap();
        let v =
            TokenValidator::with_review(reviewer, "https://victim", "aud-x", "kube-system/agent")
                .unwrap();
        let (private, _) = key();
        let sub = "system:serviceaccount:kube-system:agent";
        for claims in [
            serde_json::json!({"iss": "https://victim", "aud": "other", "sub": sub, "exp": now() + 600}),
            serde_json::json!({"iss": "https://victim", "aud": ["aud-x"], "sub": "system:serviceaccount:x:y", "exp": now() + 600}),
            serde_json::json!({"iss": "https://victim", "aud": "aud-x", "sub": sub, "exp": now() - 600}),
            serde_json::json!({"iss": "https://victim", "aud": "aud-x", "sub": sub}),
        ] {
            let t = sign(&private, claims.clone());
            let e = v.check(&format!("Bearer {t}")).await.unwrap_err();
            assert!(!matches!(e, TokenError::Unavailable(_)), "{claims}: {e:?}");
        }
        assert!(
            seen.lock().unwrap().is_empty(),
            "{:?}",
            seen.lock().unwrap()
        );
        // One that passes the checks goes to the review (which is down).
        let t = sign(
            &private,
            serde_json::json!({"iss": "https://victim", "aud": "aud-x", "sub": sub, "exp": now() + 600}),
        );
        let e = v.check(&format!("Bearer {t}")).await.unwrap_err();
        assert!(matches!(e, TokenError::Unavailable(_)), "{e:?}");
    }
}

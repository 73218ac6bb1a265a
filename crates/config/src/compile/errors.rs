//! A configuration's problems: each with its path ([`ConfigError`]), all of
//! them together ([`Errors`]), and the collector the checks add to.

use std::fmt;

/// One problem in a configuration, located by its path in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where, e.g. `control_planes[2].hostnames[0]`; empty for the whole file.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

impl ConfigError {
    /// A problem at `path`.
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// Every problem found in a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Errors(pub Vec<ConfigError>);

impl fmt::Display for Errors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            if e.path.is_empty() {
                write!(f, "{}", e.message)?;
            } else {
                write!(f, "{}: {}", e.path, e.message)?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for Errors {}

pub(super) struct Collector(pub(super) Vec<ConfigError>);

impl Collector {
    pub(super) fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError::new(path, message));
    }
}

/// Control planes left out of a compile, each with its problems.
pub type Refused = Vec<(String, Vec<ConfigError>)>;

//! `ServerOptions`: what `Server::bind` loads and where it listens; `ServerError`: why it could
//! not, or why serving stopped. Both grow with the server, so they are `#[non_exhaustive]`.

use std::path::PathBuf;

use metrale::chat::{ReasoningParser, ToolCallParser};
use metrale::{EngineError, EngineOptions};

/// How to serve a checkpoint. Build with [`ServerOptions::new`] and the setters; every other
/// field has a documented default.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerOptions {
    /// The checkpoint directory (config.json + safetensors, tokenizer.json for text, a chat
    /// template for `/v1/chat/completions`).
    pub model: PathBuf,
    /// The model's name in the API (`/v1/models`, the requests' `model`). Default: the
    /// checkpoint directory's name.
    pub served_model_name: Option<String>,
    /// Address to listen on. Default `127.0.0.1`.
    pub host: String,
    /// Port to listen on (0: any free port). Default 8000.
    pub port: u16,
    /// How the engine loads and runs the model. Default `EngineOptions::default()`.
    pub engine: EngineOptions,
    /// Where the sampling fields a request leaves out come from. Default
    /// [`GenerationConfig::Auto`].
    pub generation_config: GenerationConfig,
    /// How chat answers' tool calls are read (`--tool-call-parser`). Default
    /// [`ToolCallParser::Auto`]: the format the checkpoint's chat template teaches.
    pub tool_call_parser: ToolCallParser,
    /// How chat answers' reasoning is read (`--reasoning-parser`). Default
    /// [`ReasoningParser::Auto`]: think blocks where the template writes them.
    pub reasoning_parser: ReasoningParser,
}

/// Where the sampling fields a request leaves out (`temperature`, `top_p`, `top_k`, `min_p`,
/// `repetition_penalty`) come from. A field the request sets always wins.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum GenerationConfig {
    /// The checkpoint's `generation_config.json` where it sets the field, else OpenAI's default
    /// (temperature 1, top-p 1, every token, min-p 0, no repetition penalty). The default.
    #[default]
    Auto,
    /// OpenAI's defaults only: the checkpoint's file is not read for sampling.
    Ignore,
}

impl ServerOptions {
    /// Serve the checkpoint in `model` with every other field at its default.
    pub fn new(model: impl Into<PathBuf>) -> ServerOptions {
        ServerOptions {
            model: model.into(),
            served_model_name: None,
            host: "127.0.0.1".into(),
            port: 8000,
            engine: EngineOptions::default(),
            generation_config: GenerationConfig::default(),
            tool_call_parser: ToolCallParser::default(),
            reasoning_parser: ReasoningParser::default(),
        }
    }

    /// Set `tool_call_parser`.
    pub fn tool_call_parser(mut self, parser: ToolCallParser) -> Self {
        self.tool_call_parser = parser;
        self
    }

    /// Set `reasoning_parser`.
    pub fn reasoning_parser(mut self, parser: ReasoningParser) -> Self {
        self.reasoning_parser = parser;
        self
    }

    /// Set `served_model_name`.
    pub fn served_model_name(mut self, name: impl Into<Option<String>>) -> Self {
        self.served_model_name = name.into();
        self
    }

    /// Set `host`.
    pub fn host(mut self, host: impl Into<String>) -> Self {
        self.host = host.into();
        self
    }

    /// Set `port`.
    pub fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }

    /// Set `engine`.
    pub fn engine(mut self, engine: EngineOptions) -> Self {
        self.engine = engine;
        self
    }

    /// Set `generation_config`.
    pub fn generation_config(mut self, source: GenerationConfig) -> Self {
        self.generation_config = source;
        self
    }

    /// The name the model is served under: `served_model_name`, else the checkpoint
    /// directory's name (of its canonical path, so `.` names the directory), else `metrale`.
    pub fn model_id(&self) -> String {
        self.served_model_name.clone().unwrap_or_else(|| {
            std::fs::canonicalize(&self.model)
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "metrale".into())
        })
    }
}

/// Why the server could not start, or stopped. More kinds may come: matches keep a wildcard
/// arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The engine could not load the checkpoint.
    #[error("loading {}: {source}", path.display())]
    Load {
        /// The checkpoint directory.
        path: PathBuf,
        /// Why (boxed: an engine error is large, and this one is rare).
        #[source]
        source: Box<EngineError>,
    },
    /// The async runtime could not start.
    #[error("starting the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// The address could not be bound.
    #[error("listening on {addr}: {source}")]
    Bind {
        /// `host:port`.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving: {0}")]
    Serve(#[source] std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_the_documented_ones_and_the_name_is_the_directory_s() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let checkpoint = dir.path().join("my-model");
        std::fs::create_dir(&checkpoint).expect("a checkpoint directory");
        let o = ServerOptions::new(checkpoint.join("."));
        assert_eq!((o.host.as_str(), o.port), ("127.0.0.1", 8000));
        assert_eq!(o.engine, EngineOptions::default());
        assert_eq!(o.tool_call_parser, ToolCallParser::Auto);
        assert_eq!(o.reasoning_parser, ReasoningParser::Auto);
        assert_eq!(o.model_id(), "my-model");
        let named = o.served_model_name("served".to_string()).port(0);
        assert_eq!(named.model_id(), "served");
        assert_eq!(named.port, 0);
        assert_eq!(
            ServerOptions::new(dir.path().join("absent")).model_id(),
            "metrale"
        );
    }
}

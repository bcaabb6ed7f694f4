// PLACEHOLDER so the crate builds; the HF/chat engineer replaces this whole file.
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub fn render(
    _template: &str,
    _messages: &[ChatMessage],
    _bos_token: &str,
    _eos_token: &str,
    _add_generation_prompt: bool,
) -> anyhow::Result<String> {
    anyhow::bail!("chat templates are not implemented yet")
}

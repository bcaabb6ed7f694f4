//! Chat templates rendered as transformers' `apply_chat_template` renders them.

use std::time::Instant;

use megainfer::tokenizer::chat::{render, render_with_work, ChatMessage, MAX_TEMPLATE_WORK};

/// `chat_template` of HuggingFaceTB/SmolLM2-135M-Instruct's tokenizer_config.json.
const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// `chat_template` of meta-llama/Llama-3.2-1B-Instruct's tokenizer_config.json.
const LLAMA32: &str = r#"{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

fn user(text: &str) -> ChatMessage {
    ChatMessage::new("user", text)
}

#[test]
fn smollm2_adds_its_default_system_prompt() {
    let out = render(SMOLLM2, &[user("Hi")], "<|im_start|>", "<|im_end|>", true).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn smollm2_keeps_a_given_system_prompt_and_history() {
    let messages = [
        ChatMessage::new("system", "Be brief."),
        user("Hi"),
        ChatMessage::new("assistant", "Hello."),
        user("Bye"),
    ];
    let out = render(SMOLLM2, &messages, "<|im_start|>", "<|im_end|>", false).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    );
}

#[test]
fn llama32_renders_with_todays_date() {
    let messages = [ChatMessage::new("system", "  Be brief. "), user(" Hi ")];
    let out = render(LLAMA32, &messages, "<|begin_of_text|>", "<|eot_id|>", true).unwrap();
    let prefix = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
                  Cutting Knowledge Date: December 2023\nToday Date: ";
    let suffix = "\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
                  <|start_header_id|>assistant<|end_header_id|>\n\n";
    assert!(out.starts_with(prefix), "{out:?}");
    assert!(out.ends_with(suffix), "{out:?}");
    // strftime_now("%d %b %Y"), e.g. "26 Jul 2024".
    let date = &out[prefix.len()..out.len() - suffix.len()];
    let parts: Vec<&str> = date.split(' ').collect();
    assert_eq!(parts.len(), 3, "{date:?}");
    assert!(parts[0].len() == 2 && parts[0].chars().all(|c| c.is_ascii_digit()));
    let months = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec";
    assert!(months.split(' ').any(|m| m == parts[1]), "{date:?}");
    assert!(parts[2].len() == 4 && parts[2].parse::<u32>().unwrap() >= 2024);
}

#[test]
fn raise_exception_becomes_the_error() {
    let template = "{% for m in messages %}{% if m.role == 'system' %}\
                    {{ raise_exception('System role not supported') }}{% endif %}\
                    {{ m.content }}{% endfor %}";
    let err = render(template, &[ChatMessage::new("system", "x")], "", "", true).unwrap_err();
    assert!(
        err.to_string().contains("System role not supported"),
        "{err}"
    );
    assert_eq!(render(template, &[user("ok")], "", "", true).unwrap(), "ok");
}

#[test]
fn blocks_are_trimmed_as_in_transformers() {
    // trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before one.
    let template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n  {{ m.content }}\n    {% endif %}\n{% endfor %}";
    let out = render(template, &[user("a"), user("b")], "", "", false).unwrap();
    assert_eq!(out, "  a\n  b\n");
}

#[test]
fn python_string_methods_and_bos_eos_variables() {
    let template = "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}\
                    {% if m.content.startswith(' h') %}!{% endif %}{% endfor %}{{ eos_token }}";
    let out = render(template, &[user(" hi ")], "<s>", "</s>", false).unwrap();
    assert_eq!(out, "<s>HI!</s>");
}

#[test]
fn tojson_matches_python_json_dumps() {
    let template = "{{ {'a': 1, 'b': [2.5, none, true, 'x\"<y>'], 'c': {}} | tojson }}|\
                    {{ {'a': [1, 2]} | tojson(indent=2) }}|{{ 'é' | tojson(ensure_ascii=true) }}";
    let out = render(template, &[], "", "", false).unwrap();
    assert_eq!(
        out,
        "{\"a\": 1, \"b\": [2.5, null, true, \"x\\\"<y>\"], \"c\": {}}|\
         {\n  \"a\": [\n    1,\n    2\n  ]\n}|\"\\u00e9\""
    );
    let template = "{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}|\
                    {{ [1] | tojson(separators=none) }}";
    let out = render(template, &[], "", "", false).unwrap();
    assert_eq!(out, "{\"a\":[1,2]}|[1]");
    for separators in ["[',']", "[',', ':', ' ']", "1", "'ab'"] {
        let template = format!("{{{{ [1] | tojson(separators={separators}) }}}}");
        assert!(render(&template, &[], "", "", false).is_err(), "{template}");
    }
}

#[test]
fn template_syntax_errors_are_reported() {
    let err = render("{% for m in messages %}", &[user("x")], "", "", false).unwrap_err();
    assert!(err.to_string().contains("does not parse"), "{err}");
}

/// `template` rendered by minijinja as it comes, set up as `render` sets it up but without the
/// checks that keep a hostile template's strings and output small.
fn render_unchecked(template: &str, messages: &[ChatMessage]) -> String {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // The date as `render` writes it.
    env.add_function("strftime_now", |format: String| {
        render(
            &format!("{{{{ strftime_now({format:?}) }}}}"),
            &[],
            "",
            "",
            false,
        )
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string()))
    });
    let result = env.template_from_str(template).and_then(|t| {
        t.render(minijinja::context! {
            messages => messages,
            bos_token => "<s>",
            eos_token => "</s>",
            add_generation_prompt => true,
        })
    });
    match result {
        Ok(out) => out,
        Err(e) => format!("error: {e}"),
    }
}

#[test]
fn the_size_checks_change_no_output() {
    let messages = [
        ChatMessage::new("system", "Be brief."),
        user("Hi <b> & 'x'\nsecond line"),
        ChatMessage::new("assistant", "Hello."),
        user("What is 2+2?"),
    ];
    for template in [
        SMOLLM2,
        // Operators, on strings and on everything else.
        "{% for m in messages %}{{ '<|' + m.role + '|>' ~ m.content ~ '\n' }}{% endfor %}\
         {{ [1, 2] + [3] }}{{ [1] * 3 }}{{ 3 * 'ab' }}{{ 2 * 3 + 1 }}{{ 1.5 * 2 }}\
         {{ undefined_thing ~ 'x' }}{{ none ~ 1 }}{{ 'a' in 'cat' }}{{ 1 in [1] }}\
         {{ 1 < 2 < 3 }}{{ 'b' not in messages[0].content }}{{ undefined_thing }}",
        // Loops, conditions, namespaces, short-circuits.
        "{% set ns = namespace(x='') %}{% for m in messages %}\
         {% if loop.first %}F{% elif loop.last %}L{% else %}{{ loop.index }}{% endif %}\
         {% set ns.x = ns.x ~ m.role[0] %}{{ m['content'] * 2 }}{% endfor %}{{ ns.x }}\
         {{ messages[0].content if messages and messages[0].role == 'system' else 'none' }}\
         {{ a or 'b' }}{{ 1 and 0 }}{% for i in range(3) %}{{ loop.cycle('a', 'b') }}{% endfor %}",
        // Macros with defaults and callers, set and filter blocks, recursive loops, blocks.
        "{% macro r(m, p='-') %}{{ p }}{{ m.role|upper }}{{ caller() if caller else '' }}\
         {% endmacro %}{% for m in messages %}{{ r(m) }}{% call r(m, '+') %}C{{ m.content|length }}\
         {% endcall %}{% endfor %}{% set x %}{% for m in messages %}{{ m.content }}|{% endfor %}\
         {% endset %}{{ x|length }}{% filter upper %}abc{{ x[:3] }}{% endfilter %}\
         {% for item in [[1, [2, [3]]], [4]] recursive %}[{% if item is iterable %}\
         {{ loop(item) }}{% else %}{{ item }}{% endif %}]{% endfor %}\
         {% block b %}B{{ 1 + 1 }}{% endblock %}{{ self.b() }}",
        // The builtins behind checks, with positional and keyword arguments.
        "{{ messages|map(attribute='role')|join(', ') }}{{ x|join }}{{ 'a\nb\nc'|indent(2) }}\
         {{ 'a\nb'|indent(width=3, first=true) }}{{ '%s-%05d'|format('x', 42) }}\
         {{ '{}/{:>4}'.format('a', 'b') }}{{ '-'.join(['a', 'b']) }}\
         {{ 'aXbX'.replace('X', '--') }}{{ 'aXbX'.replace('X', '-', 1) }}\
         {{ 'aXbX'|replace('X', '') }}{{ 'ab'|upper }}{{ 'AB'|lower }}{{ 'ab cd'|title }}\
         {{ 'ab'|capitalize }}{{ ' a '|trim }}{{ 5|string }}{{ 'a b'|split|list }}\
         {{ 'a\nb'|lines|list }}{{ '<a>'|escape }}{{ '<a>'|e }}{{ [1, 'a']|pprint }}\
         {{ '<a>'|safe }}{{ 'abc' is startingwith 'a' }}{{ 'abc' is endingwith 'x' }}\
         {{ 'a' is in 'abc' }}{{ 'ab'.upper() }}{{ 'AB'.lower() }}{{ 'ab cd'.title() }}\
         {{ 'ab'.capitalize() }}{{ messages|selectattr('role', 'eq', 'user')|list|length }}",
        // The list builtins and list operators behind checks, on lists, strings, maps and
        // iterables of unknown length.
        "{% set a = [3, 1, 2] %}{{ a + [] }}{{ [] + a }}{{ a * 2 }}{{ 2 * a }}{{ [] * 3 }}\
         {{ a * 0 }}{{ (a|select('odd')) + a }}{{ a + (a|reject('odd')) }}{{ range(3) + a }}\
         {{ a|list }}{{ 'abc'|list }}{{ a|sort }}{{ a|sort(reverse=true) }}{{ a|reverse|list }}\
         {{ 'abc'|reverse }}{{ a|last }}{{ 'abc'|last }}{{ (a * 2)|unique|list }}\
         {{ {'b': 1, 'a': 2}|dictsort }}{{ {'b': 1}|items|list }}{{ {'b': 1}|list }}\
         {{ a|batch(2)|list }}{{ a|batch(2, 0)|list }}{{ a|slice(2)|list }}\
         {{ a|slice(2, 9)|list }}{{ a|map('string')|list }}{{ a|select('odd')|list }}\
         {{ a|reject('odd')|list }}{{ messages|selectattr('role', 'eq', 'user')|list|length }}\
         {{ messages|rejectattr('role', 'eq', 'user')|map(attribute='role')|list }}\
         {{ messages|groupby('role')|map(attribute='grouper')|list }}{{ a|chain([4], [])|list }}\
         {{ a|zip('xyz', [0, 1])|list }}{{ 'a b  c'|split|list }}{{ 'a,b'|split(',')|list }}\
         {{ 'a b c'|split(none, 1)|list }}{{ 'a\nb'|lines }}{{ 'a,b,c'.split(',', 1) }}\
         {{ 'a b'.split() }}{{ 'a\nb\n'.splitlines() }}{{ 'a\nb\n'.splitlines(true) }}\
         {{ 'abcb'.count('b') }}{{ 1 in a * 2 }}{{ (a * 3)|length }}",
        // Slices (collected by the checks), comparisons (counted) and lists made from lazy
        // lists (copied before `+`, `*` and `chain` build on them), indexed, walked, printed.
        "{% set a = [3, 1, 2, 5, 4] %}{{ a[1:] }}{{ a[1:3] }}{{ a[::-1] }}{{ a[::2] }}\
         {{ a[-2:] }}{{ a[:-1]|list }}{{ a[1:]|length }}{{ a[1:][0] }}{{ (a[1:] + a[:1])|list }}\
         {{ (a * 2)[3:6]|list }}{{ 'héllo'[1:3] }}{{ 'abc'[::-1] }}{{ none[1:] }}\
         {{ (a|chain([6]))[5] }}{{ (a|chain([6]))|length }}{{ (range(3)|chain([6]))|list }}\
         {{ a[1:] is sequence }}{{ (a|chain(a)) is sequence }}{{ (range(3)|chain(a)) is sequence }}\
         {{ ((a + a) + a)|list }}{{ ((a * 2) * 2)|length }}{{ (a[1:] * 2)|list }}\
         {{ ((a|chain(a))|chain(a))|list }}{{ a|sum }}{{ a|min }}{{ a|max }}{{ a[1:]|sum }}\
         {{ 'a' == 'a' }}{{ 'a' < 'b' }}{{ [1, 2] == [1, 2] }}{{ [1] < [2] }}\
         {{ {'a': 1} == {'a': 1} }}{{ 1 == 1.0 }}{{ 'a' != none }}{{ a[1:] == a[1:] }}\
         {{ messages[1:]|map(attribute='role')|join(',') }}\
         {% for m in messages[1:] %}{{ m.role }}{% endfor %}{{ (messages|reverse|list)[0].role }}\
         {{ 'a b'.split()[1:] }}{{ a[1:]|pprint }}{{ (a|chain(a))|pprint }}{{ (a + a)|pprint }}\
         {{ 'b' in a[1:] }}{{ 2 in (a|chain(a)) }}{{ a|sort(reverse=true) == a|sort|reverse|list }}\
         {{ 'ab'.isalpha() }}{{ '-'.join(a[1:]|map('string')) }}{{ a[1:]|unique|list }}",
        // Indexing, which the checks count: lists, lazy lists, strings, maps, objects.
        "{% set a = [3, 1, 2] %}{% set ns = namespace(x=1) %}{{ a[1] }}{{ a[-1] }}{{ a[7] }}\
         {{ a[1:][1] }}{{ a[1:][-1] }}{{ (a * 2)[4] }}{{ (a + a)[3] }}{{ (a|chain(a))[4] }}\
         {{ 'héllo'[1] }}{{ 'abc'[-1] }}{{ 'abc'[9] }}{{ {'a': 1}['a'] }}{{ {'a': 1}['b'] }}\
         {{ messages[0]['role'] }}{{ messages[1:][0].role }}{{ ns['x'] }}{{ a['x'] }}\
         {{ none['x'] }}{{ range(5)[2] }}{{ (a|reverse)[0] }}",
        "{{ [1, 2][0:1:0] }}",
        "{{ 5[1:] }}",
        "{{ [1, 2]['a':] }}",
        "{{ [1] + 'a' }}",
        "{{ [1] * 'a' }}",
        "{{ [1] * -1 }}",
        // Escaping turned on.
        "{% autoescape true %}{{ '<x>' ~ messages[1].content }}{{ ['<a>', 'b']|join('&') }}\
         {{ '<%s>'|format('&') }}{{ messages[1].content|replace('&', '+') }}{% endautoescape %}",
        // Errors, with their line.
        "{% if true %}{{ 1 }}{% endif %}\n{{ 'x' * 'y' }}",
        "{{ 'a' + 1 }}",
    ] {
        let unchecked = render_unchecked(template, &messages);
        let checked = match render(template, &messages, "<s>", "</s>", true) {
            Ok(out) => out,
            Err(e) => format!(
                "error: {}",
                e.to_string().replace("chat template failed: ", "")
            ),
        };
        assert_eq!(checked, unchecked, "{template}");
    }
}

/// `n` messages: a system prompt, then a user and the assistant in turn, with markup, quotes,
/// new lines and non-ASCII text, of varied lengths.
fn conversation(n: usize) -> Vec<ChatMessage> {
    (0..n)
        .map(|i| {
            let role = match i {
                0 => "system",
                _ if i % 2 == 1 => "user",
                _ => "assistant",
            };
            let text = format!(
                "Message {i}: <b>bold</b> & 'quoted' \"text\"\n  ünïcode ✓ {}",
                "word ".repeat(i % 60)
            );
            ChatMessage::new(role, text)
        })
        .collect()
}

/// Real templates (the ones these tests and the fuzz corpus hold) render a 4,000-message
/// conversation far within the work limit, and as minijinja renders them without the checks.
#[test]
fn real_templates_stay_far_from_the_work_limit() {
    let messages = conversation(4000);
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/chat_template");
    let mut templates = vec![
        ("SmolLM2".to_string(), SMOLLM2.to_string()),
        ("Llama 3.2".to_string(), LLAMA32.to_string()),
    ];
    let mut seeds: Vec<_> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    seeds.sort();
    for seed in seeds {
        let name = seed.file_name().unwrap().to_string_lossy().into_owned();
        templates.push((name, std::fs::read_to_string(&seed).unwrap()));
    }
    assert!(templates.len() >= 4);
    for (name, template) in &templates {
        let start = Instant::now();
        let (out, work) = render_with_work(template, &messages, "<s>", "</s>", true)
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        println!(
            "{name}: {} messages, {} bytes out, work {work} of {MAX_TEMPLATE_WORK}, {:?}",
            messages.len(),
            out.len(),
            start.elapsed()
        );
        assert!(work < MAX_TEMPLATE_WORK / 10, "{name}: work {work}");
        assert!(out.contains("Message 3999: "), "{name}");
        // minijinja's own `tojson` writes JSON unlike Python's, so a template that uses it
        // renders differently without the checks' environment.
        if !template.contains("tojson") {
            assert_eq!(out, render_unchecked(template, &messages), "{name}");
        }
    }
}

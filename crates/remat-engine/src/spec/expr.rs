//! The condition language of `when`: identifiers (model-config keys and `layer`), numbers,
//! bools, strings, `==`, `!=`, `<`, `<=`, `>`, `>=`, `%`, `&&`, `||`, `!` and parentheses.
//!
//! Parsed with a shunting-yard pass into reverse Polish notation and evaluated with a value
//! stack: no recursion, so no input can overflow the call stack.

use super::types::Value;

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Ident(String),
    Lit(Value),
    Op(BinOp),
    Not,
    Open,
    Close,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum BinOp {
    Or,
    And,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    Rem,
}

impl BinOp {
    fn precedence(self) -> u8 {
        match self {
            BinOp::Or => 1,
            BinOp::And => 2,
            BinOp::Eq | BinOp::Ne => 3,
            BinOp::Lt | BinOp::Le | BinOp::Gt | BinOp::Ge => 4,
            BinOp::Rem => 5,
        }
    }
}

const NOT_PRECEDENCE: u8 = 6;

/// A parsed condition, ready to evaluate against any number of configs.
#[derive(Debug, Clone, PartialEq)]
pub struct Condition {
    rpn: Vec<Token>,
}

fn lex(text: &str) -> Result<Vec<Token>, String> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        let next = chars.get(i + 1).copied();
        let two = |t: Token| (t, 2);
        let (token, len) = match (c, next) {
            ('(', _) => (Token::Open, 1),
            (')', _) => (Token::Close, 1),
            ('&', Some('&')) => two(Token::Op(BinOp::And)),
            ('|', Some('|')) => two(Token::Op(BinOp::Or)),
            ('=', Some('=')) => two(Token::Op(BinOp::Eq)),
            ('!', Some('=')) => two(Token::Op(BinOp::Ne)),
            ('<', Some('=')) => two(Token::Op(BinOp::Le)),
            ('>', Some('=')) => two(Token::Op(BinOp::Ge)),
            ('<', _) => (Token::Op(BinOp::Lt), 1),
            ('>', _) => (Token::Op(BinOp::Gt), 1),
            ('%', _) => (Token::Op(BinOp::Rem), 1),
            ('!', _) => (Token::Not, 1),
            ('"', _) | ('\'', _) => lex_string(&chars, i)?,
            _ if c.is_ascii_digit() || c == '-' => lex_number(&chars, i)?,
            _ if c.is_alphabetic() || c == '_' => lex_ident(&chars, i),
            _ => return Err(format!("unexpected character `{c}` at offset {i}")),
        };
        tokens.push(token);
        i += len;
    }
    Ok(tokens)
}

fn lex_string(chars: &[char], start: usize) -> Result<(Token, usize), String> {
    let quote = chars[start];
    let end = chars[start + 1..]
        .iter()
        .position(|&c| c == quote)
        .ok_or_else(|| format!("unterminated string starting at offset {start}"))?;
    let text: String = chars[start + 1..start + 1 + end].iter().collect();
    Ok((Token::Lit(Value::Str(text)), end + 2))
}

fn lex_number(chars: &[char], start: usize) -> Result<(Token, usize), String> {
    let mut end = start + 1;
    while end < chars.len() && (chars[end].is_ascii_alphanumeric() || chars[end] == '.') {
        end += 1;
    }
    let text: String = chars[start..end].iter().collect();
    if let Ok(i) = text.parse::<i64>() {
        return Ok((Token::Lit(Value::Int(i)), end - start));
    }
    match text.parse::<f64>() {
        Ok(x) => Ok((Token::Lit(Value::Float(x)), end - start)),
        Err(_) => Err(format!("bad number `{text}`")),
    }
}

fn lex_ident(chars: &[char], start: usize) -> (Token, usize) {
    let mut end = start + 1;
    while end < chars.len()
        && (chars[end].is_alphanumeric() || chars[end] == '_' || chars[end] == '.')
    {
        end += 1;
    }
    let text: String = chars[start..end].iter().collect();
    let token = match text.as_str() {
        "true" => Token::Lit(Value::Bool(true)),
        "false" => Token::Lit(Value::Bool(false)),
        _ => Token::Ident(text),
    };
    (token, end - start)
}

/// Operator-stack entries of the shunting-yard pass.
enum Pending {
    Bin(BinOp),
    Not,
    Open,
}

impl Condition {
    pub fn parse(text: &str) -> Result<Self, String> {
        let tokens = lex(text)?;
        if tokens.is_empty() {
            return Err("empty condition".into());
        }
        let mut rpn = Vec::new();
        let mut ops: Vec<Pending> = Vec::new();
        // Alternates between expecting an operand and expecting an operator; catches
        // `a b`, `&& a`, `a ==` and friends.
        let mut expect_operand = true;
        for token in tokens {
            match token {
                Token::Ident(_) | Token::Lit(_) => {
                    if !expect_operand {
                        return Err("two operands in a row".into());
                    }
                    rpn.push(token);
                    expect_operand = false;
                }
                Token::Not => {
                    if !expect_operand {
                        return Err("`!` after an operand".into());
                    }
                    ops.push(Pending::Not);
                }
                Token::Open => {
                    if !expect_operand {
                        return Err("`(` after an operand".into());
                    }
                    ops.push(Pending::Open);
                }
                Token::Close => {
                    if expect_operand {
                        return Err("`)` where an operand was expected".into());
                    }
                    loop {
                        match ops.pop() {
                            Some(Pending::Open) => break,
                            Some(Pending::Bin(op)) => rpn.push(Token::Op(op)),
                            Some(Pending::Not) => rpn.push(Token::Not),
                            None => return Err("unbalanced `)`".into()),
                        }
                    }
                }
                Token::Op(op) => {
                    if expect_operand {
                        return Err("operator where an operand was expected".into());
                    }
                    while let Some(top) = ops.last() {
                        let top_prec = match top {
                            Pending::Bin(t) => t.precedence(),
                            Pending::Not => NOT_PRECEDENCE,
                            Pending::Open => break,
                        };
                        if top_prec < op.precedence() {
                            break;
                        }
                        match ops.pop() {
                            Some(Pending::Bin(t)) => rpn.push(Token::Op(t)),
                            _ => rpn.push(Token::Not),
                        }
                    }
                    ops.push(Pending::Bin(op));
                    expect_operand = true;
                }
            }
        }
        if expect_operand {
            return Err("condition ends where an operand was expected".into());
        }
        while let Some(op) = ops.pop() {
            match op {
                Pending::Bin(op) => rpn.push(Token::Op(op)),
                Pending::Not => rpn.push(Token::Not),
                Pending::Open => return Err("unbalanced `(`".into()),
            }
        }
        Ok(Self { rpn })
    }

    /// Evaluates to a bool; `lookup` resolves identifiers.
    pub fn eval(&self, lookup: &dyn Fn(&str) -> Option<Value>) -> Result<bool, String> {
        let mut stack: Vec<Value> = Vec::new();
        for token in &self.rpn {
            match token {
                Token::Lit(v) => stack.push(v.clone()),
                Token::Ident(name) => stack.push(lookup(name).ok_or_else(|| {
                    format!("unknown identifier `{name}` (not in the model config)")
                })?),
                Token::Not => match stack.pop() {
                    Some(Value::Bool(b)) => stack.push(Value::Bool(!b)),
                    other => return Err(format!("`!` needs a bool, got {}", show(&other))),
                },
                Token::Op(op) => {
                    let (Some(rhs), Some(lhs)) = (stack.pop(), stack.pop()) else {
                        return Err("malformed condition".into());
                    };
                    stack.push(apply(*op, lhs, rhs)?);
                }
                Token::Open | Token::Close => return Err("malformed condition".into()),
            }
        }
        match (stack.pop(), stack.is_empty()) {
            (Some(Value::Bool(b)), true) => Ok(b),
            (other, _) => Err(format!("condition must be a bool, got {}", show(&other))),
        }
    }
}

fn show(v: &Option<Value>) -> String {
    match v {
        Some(v) => format!("`{v}`"),
        None => "nothing".into(),
    }
}

fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::Int(i) => Some(*i as f64),
        Value::Float(x) => Some(*x),
        _ => None,
    }
}

fn equal(lhs: &Value, rhs: &Value) -> Result<bool, String> {
    match (lhs, rhs) {
        (Value::Bool(a), Value::Bool(b)) => Ok(a == b),
        (Value::Str(a), Value::Str(b)) => Ok(a == b),
        (Value::Int(a), Value::Int(b)) => Ok(a == b),
        _ => match (as_f64(lhs), as_f64(rhs)) {
            (Some(a), Some(b)) => Ok(a == b),
            _ => Err(format!("cannot compare `{lhs}` with `{rhs}`")),
        },
    }
}

fn apply(op: BinOp, lhs: Value, rhs: Value) -> Result<Value, String> {
    let num = |v: &Value| as_f64(v).ok_or_else(|| format!("`{v}` is not a number"));
    Ok(match op {
        BinOp::And | BinOp::Or => match (&lhs, &rhs) {
            (Value::Bool(a), Value::Bool(b)) => {
                Value::Bool(if op == BinOp::And { *a && *b } else { *a || *b })
            }
            _ => return Err(format!("`&&`/`||` need bools, got `{lhs}` and `{rhs}`")),
        },
        BinOp::Eq => Value::Bool(equal(&lhs, &rhs)?),
        BinOp::Ne => Value::Bool(!equal(&lhs, &rhs)?),
        BinOp::Lt => Value::Bool(num(&lhs)? < num(&rhs)?),
        BinOp::Le => Value::Bool(num(&lhs)? <= num(&rhs)?),
        BinOp::Gt => Value::Bool(num(&lhs)? > num(&rhs)?),
        BinOp::Ge => Value::Bool(num(&lhs)? >= num(&rhs)?),
        BinOp::Rem => match (&lhs, &rhs) {
            (Value::Int(_), Value::Int(0)) => return Err("`%` by zero".into()),
            (Value::Int(a), Value::Int(b)) => Value::Int(a.rem_euclid(*b)),
            _ => return Err(format!("`%` needs integers, got `{lhs}` and `{rhs}`")),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eval(text: &str) -> Result<bool, String> {
        let lookup = |name: &str| match name {
            "use_qk_norm" => Some(Value::Bool(true)),
            "attention_bias" => Some(Value::Bool(false)),
            "num_experts" => Some(Value::Int(8)),
            "layer" => Some(Value::Int(3)),
            "act" => Some(Value::Str("silu".into())),
            _ => None,
        };
        Condition::parse(text)?.eval(&lookup)
    }

    #[test]
    fn evaluates_operators_with_precedence() {
        assert_eq!(eval("use_qk_norm"), Ok(true));
        assert_eq!(eval("!use_qk_norm"), Ok(false));
        assert_eq!(eval("!attention_bias && use_qk_norm"), Ok(true));
        assert_eq!(eval("attention_bias || num_experts == 8"), Ok(true));
        assert_eq!(eval("attention_bias || num_experts != 8"), Ok(false));
        assert_eq!(eval("!(attention_bias || use_qk_norm)"), Ok(false));
        assert_eq!(eval("act == \"silu\" && 'x' != act"), Ok(true));
        assert_eq!(eval("layer % 2 == 1"), Ok(true));
        assert_eq!(eval("layer >= 3 && layer < 4 && num_experts > 0"), Ok(true));
        assert_eq!(eval("num_experts == 8.0"), Ok(true));
        assert_eq!(eval("false || true && false"), Ok(false));
        assert_eq!(eval("!!use_qk_norm"), Ok(true));
    }

    #[test]
    fn rejects_malformed_and_ill_typed_conditions() {
        for bad in [
            "",
            "a b",
            "&& a",
            "use_qk_norm ==",
            "(use_qk_norm",
            "use_qk_norm)",
            "a = b",
            "#",
            "\"open",
        ] {
            assert!(Condition::parse(bad).is_err(), "{bad:?} should not parse");
        }
        assert!(
            eval("nope")
                .unwrap_err()
                .contains("unknown identifier `nope`")
        );
        assert!(eval("num_experts").unwrap_err().contains("must be a bool"));
        assert!(eval("num_experts && true").is_err());
        assert!(eval("act < 3").is_err());
        assert!(eval("layer % 0 == 1").is_err());
    }

    #[test]
    fn deep_nesting_does_not_recurse() {
        let text = format!("{}use_qk_norm{}", "(".repeat(100_000), ")".repeat(100_000));
        assert_eq!(eval(&text), Ok(true));
    }
}

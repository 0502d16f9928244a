// Markdown to DOM nodes, as text: every character of the source ends up in a Text node or is
// consumed as markdown syntax, and the only elements made are the ones named in this file. Nothing
// is ever parsed as HTML, so `<script>` or `<img onerror=...>` in a model's answer shows as those
// characters, and a link is made only for an http(s) address.
//
// Blocks: fenced code (``` or ~~~, an unclosed fence runs to the end, as while it streams),
// headings, quotes, lists, rules, paragraphs (line breaks kept). Inline: `code`, **strong**,
// *emphasis*, ~~strike~~, [text](https://...).

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( {0,3})([-*+]|\d{1,9}[.)])\s+(.*)$/;
const INDENTED = /^ {2,}\S/;

const INLINE = new RegExp(
  [
    "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)", // 1, 2: code span
    "\\*\\*(?=\\S)([\\s\\S]*?\\S)\\*\\*", // 3: strong
    "(?<!\\w)__(?=\\S)([\\s\\S]*?\\S)__(?!\\w)", // 4: strong
    "\\*(?=[^\\s*])([\\s\\S]*?[^\\s*])\\*", // 5: emphasis
    "(?<!\\w)_(?=[^\\s_])([\\s\\S]*?[^\\s_])_(?!\\w)", // 6: emphasis
    "~~(?=\\S)([\\s\\S]*?\\S)~~", // 7: strike
    "\\[([^\\]\\n]+)\\]\\(([^()\\s]+)\\)", // 8, 9: link
  ].join("|"),
  "g",
);

function element(name, children = []) {
  const node = document.createElement(name);
  node.append(...children);
  return node;
}

// Inline markdown of `text` as a list of nodes.
export function inline(text) {
  const nodes = [];
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) nodes.push(document.createTextNode(text.slice(last, match.index)));
    last = match.index + match[0].length;
    const [whole, , code, strong, strong2, emphasis, emphasis2, strike, label, href] = match;
    if (code !== undefined) {
      const inner = code.length > 2 && code.startsWith(" ") && code.endsWith(" ") ? code.slice(1, -1) : code;
      nodes.push(element("code", [inner]));
    } else if (strong !== undefined || strong2 !== undefined) {
      nodes.push(element("strong", inline(strong ?? strong2)));
    } else if (emphasis !== undefined || emphasis2 !== undefined) {
      nodes.push(element("em", inline(emphasis ?? emphasis2)));
    } else if (strike !== undefined) {
      nodes.push(element("del", inline(strike)));
    } else if (/^https?:\/\//i.test(href)) {
      const link = element("a", inline(label));
      link.href = href;
      link.rel = "noopener noreferrer nofollow";
      link.target = "_blank";
      nodes.push(link);
    } else {
      nodes.push(document.createTextNode(whole)); // javascript:, data:, relative: not a link
    }
  }
  if (last < text.length) nodes.push(document.createTextNode(text.slice(last)));
  return nodes;
}

function codeBlock(lines, language) {
  const code = element("code", [lines.join("\n")]);
  if (language) code.dataset.language = language;
  const pre = element("pre", [code]);
  pre.className = "code";
  return pre;
}

// Block markdown of `lines` as a list of nodes.
function blocks(lines) {
  const nodes = [];
  let i = 0;
  const startsBlock = (line) =>
    line.trim() === "" || FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    ITEM.test(line);
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (line.trim() === "") {
      i += 1;
    } else if ((match = FENCE.exec(line))) {
      const marker = match[1];
      const body = [];
      for (i += 1; i < lines.length && !lines[i].trim().startsWith(marker); i += 1) body.push(lines[i]);
      i += 1;
      nodes.push(codeBlock(body, match[2]));
    } else if ((match = HEADING.exec(line))) {
      nodes.push(element(`h${Math.min(match[1].length + 2, 6)}`, inline(match[2])));
      i += 1;
    } else if (RULE.test(line)) {
      nodes.push(element("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const body = [];
      for (; i < lines.length && (match = QUOTE.exec(lines[i])); i += 1) body.push(match[1]);
      nodes.push(element("blockquote", blocks(body)));
    } else if ((match = ITEM.exec(line))) {
      const ordered = /\d/.test(match[2]);
      const list = element(ordered ? "ol" : "ul");
      if (ordered && parseInt(match[2], 10) !== 1) list.start = parseInt(match[2], 10);
      while (i < lines.length && (match = ITEM.exec(lines[i])) && /\d/.test(match[2]) === ordered) {
        const body = [match[3]];
        // An item goes on over the indented lines below it (and blank lines between them).
        for (i += 1; i < lines.length; i += 1) {
          const next = lines[i];
          if (INDENTED.test(next) || (next.trim() === "" && INDENTED.test(lines[i + 1] ?? ""))) {
            body.push(next.replace(/^ {2,4}/, ""));
          } else if (!startsBlock(next)) {
            body.push(next); // a lazy continuation line
          } else {
            break;
          }
        }
        list.append(element("li", body.length === 1 ? inline(body[0]) : blocks(body)));
      }
      nodes.push(list);
    } else {
      const body = [line];
      for (i += 1; i < lines.length && !startsBlock(lines[i]); i += 1) body.push(lines[i]);
      nodes.push(element("p", inline(body.join("\n"))));
    }
  }
  return nodes;
}

// Replaces the children of `target` with `source` rendered.
export function renderMarkdown(source, target) {
  target.replaceChildren(...blocks(source.replace(/\r\n?/g, "\n").split("\n")));
}

"""The chat page's files (HTML, CSS, ES modules), shipped as package data and served by
`jinfer_serve.webpage`."""

// The console's own script: what htmx does not do by itself. No eval, no inline code:
// the pages' Content-Security-Policy allows scripts from this API only.
(function () {
  "use strict";
  // A refusal the console rendered (HTML: a viewer's 403, a 409 naming the running
  // operation) is shown where the answer goes; an error that is not the console's
  // (JSON, a proxy's page) leaves the page as it was.
  document.addEventListener("htmx:beforeSwap", function (event) {
    var xhr = event.detail.xhr;
    var type = xhr.getResponseHeader("Content-Type") || "";
    if (xhr.status >= 400 && type.indexOf("text/html") === 0) {
      event.detail.shouldSwap = true;
      event.detail.isError = false;
    }
  });
  // The banner: shown while the API does not answer the live parts' polls.
  function lost(on) {
    document.body.classList.toggle("lost", on);
  }
  document.addEventListener("htmx:sendError", function () { lost(true); });
  document.addEventListener("htmx:afterRequest", function (event) {
    if (event.detail.xhr && event.detail.xhr.status > 0 && event.detail.xhr.status < 500) {
      lost(false);
    }
  });
})();

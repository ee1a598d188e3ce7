// Takosumi dashboard: follows a running Run's stream (Server-Sent Events) and keeps its
// timeline and log current; reloads the page when the Run settles. Served from /assets
// under a CSP that allows no inline script.
(function () {
  "use strict";
  function follow(log) {
    if (log.dataset.terminal === "true" || !window.EventSource) return;
    var events = document.getElementById("events");
    var fresh = true;
    var source = new EventSource(log.dataset.stream);
    function reset() {
      // The stream starts from the beginning: it replaces what the page was rendered with.
      if (!fresh) return;
      fresh = false;
      log.textContent = "";
      if (events) events.textContent = "";
    }
    var step = null;
    source.addEventListener("event", function (m) {
      reset();
      var e = JSON.parse(m.data).event;
      if (!events) return;
      var li = document.createElement("li");
      li.dataset.event = e.kind;
      var at = document.createElement("span");
      at.className = "muted";
      at.textContent = (e.at || "") + " ";
      var kind = document.createElement("strong");
      kind.textContent = e.kind;
      var who = document.createElement("span");
      who.className = "muted";
      who.textContent = " " + e.actor;
      li.append(at, kind, who);
      events.append(li);
    });
    source.addEventListener("log", function (m) {
      reset();
      var l = JSON.parse(m.data);
      if (l.step !== step) {
        if (log.textContent && !log.textContent.endsWith("\n")) log.append("\n");
        log.append("== " + l.step + " ==\n");
        step = l.step;
      }
      log.append(l.text);
      log.scrollTop = log.scrollHeight;
    });
    source.addEventListener("status", function (m) {
      reset();
      var s = JSON.parse(m.data).status;
      // A settled status comes with `end`, and the page reloads to show all of it.
      if (["planned", "applied", "failed", "canceled", "unknown_outcome"].indexOf(s) >= 0) return;
      document.querySelectorAll("h1 [data-testid=status]").forEach(function (b) {
        b.textContent = s;
        b.className = "badge status-" + s;
      });
      if (s === "held" && document.body.dataset.seenHeld !== "1" && !document.querySelector("[data-testid=hold]")) {
        // A hold comes with its reason and the Approve button: show them.
        document.body.dataset.seenHeld = "1";
        source.close();
        window.location.reload();
      }
    });
    source.addEventListener("end", function () {
      source.close();
      window.location.reload();
    });
  }
  document.addEventListener("DOMContentLoaded", function () {
    var log = document.getElementById("log");
    if (log && log.dataset.stream) follow(log);
  });
})();
